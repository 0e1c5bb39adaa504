"""Paged causal GQA attention: the torch twin :func:`paged_attention_torch` (a gather of each sequence's
whole context; twin of ``reference/model/attention.causal_attention``), the split-KV ("flash-decoding")
kernels for decode and verify steps and a flash-attention-2 kernel for prefill chunks, one :class:`KernelOp`
(:data:`paged_attention`).

B sequences; sequence b owns query rows ``cu_seqlens[b] .. cu_seqlens[b+1]-1`` (at most
``max_query_len``: 1 for decode, k+1 <= 16 for a verify, up to a prefill chunk's 2048) at ``positions``,
and ``context_lens[b]`` keys in its pages. Row n of sequence b at position p, query head h::

    o[n, h] = sum_t softmax_t(q[n, h] . k[slot(b, t), j(h)] * D^-1/2) v[slot(b, t), j(h)]
              over t < context_lens[b], t <= p, block_tables[b, t // page_size] >= 0
    slot(b, t) = block_tables[b, t // page_size] * page_size + t % page_size,   j(h) = h // (H / Hkv)

Scores and softmax in fp32; a row that sees no key (a padding sequence: ``context_lens[b] = 0``)
gets zeros. K/V are read straight from the flat slot tensors ``[S, Hkv, D]`` through the block
table, with masked loads, so a slot outside a sequence's context (NaN poison included) is never read.

Steps of at most ``MAX_QUERY_LEN`` rows per sequence (decode, verify) run two kernels, a fixed grid
for a given batch shape (CUDA graphs), no host sync, no atomics:

1. ``_split_kernel``, one program per (sequence, KV head, split of ``split_len`` keys): the G = H/Hkv
   query heads of that KV head times the sequence's rows form one ``[Tq * G, D]`` tile (G = 6, Tq = 8:
   48 rows, padded to 64), which streams its split's keys in ``block_n`` chunks with an online
   softmax (base 2) and writes the normalised partial output and its log-sum-exp. The loop runs to
   the split's end or the context's, whichever comes first (a runtime bound: one compiled variant
   per model and tile, whatever the contexts). ``split_len`` is picked from the host-side maximum
   context (``block_tables.shape[1] * page_size``) so that the B * Hkv * splits programs put about
   ``PROGRAMS_PER_SM`` on each SM (:func:`plan_splits`).
2. ``_merge_kernel``, one program per (sequence x row, query head, D block of 64): combines the
   splits that hold keys of the row's sequence, ``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``,
   reading up to ``MERGE_SPLITS`` partials per tile (online across tiles).

With a single split the first kernel writes the output itself and the merge is not launched.

Bound: memory. Each step must read ``sum_b context_lens[b] * Hkv * D * 2 * itemsize`` bytes
of K/V; the partials (``Tq * G * D`` fp32 per program) stay in L2 at these sizes. At B = 1 that
floor is of the order of a launch's latency, so launch latency and the merge matter as much as bandwidth
(bench/kernels/bench_paged_attention.py measures both against the floor).

Longer steps (prefill chunks) run ``_prefill_kernel`` (:func:`paged_attention_prefill`), flash-attention 2
over the pages: one program per (query block, sequence, group of ``heads_per_program`` query heads of one
KV head). Its ``[block_m, D]`` tile stacks ``block_m / heads_per_program`` consecutive rows of the sequence
times those heads (row-major: tile row m is row m // heads_per_program, head m % heads_per_program), so each
K/V tile it loads serves every stacked head, and a tile spans few positions: the causal diagonal, where
the mask discards work, is that many keys wide. ``heads_per_program`` is the largest power of two dividing
G (8 of the 35B-A3B's 8: 16 rows x 8 heads; 2 of the 27B's 6: 64 rows x 2 heads), so no tile row is padding.
Each program streams keys ``0 .. p_last`` (its last row's position; never past the context) in ``block_n``
tiles, QK^T and PV on tensor cores (fp32 accumulate), online softmax in fp32 base 2: first the tiles every
row of the block sees whole (below its first row's position: no causal mask), then the diagonal tiles
under the mask. Keys past a block's last row (the causal triangle's upper half) are never loaded. The grid is
``(H / heads_per_program, B, cdiv(max_query_len, rows per block))``: programs past a sequence's rows find
nothing to attend and store nothing, so the host needs only ``max_query_len`` (no sync); query blocks go
latest first, so the longest programs start in the first wave.

Bound: compute. A chunk does ``4 * H * D * sum_n visible(n)`` FLOPs (QK^T and PV; visible(n) = keys row n
sees), far above its bytes: 2048 rows over a 4096-token context on the 35B-A3B shape is 0.1 TFLOP against
about 40 MB of Q, K, V and output. The twin's ``[B, Hkv, G, Tq, Tctx]`` fp32 scores (512 MB per layer at that
shape, 4 GB at a 32k context) and its gathered K/V copies are never materialised: the kernel's memory is its
output (bench/kernels/bench_paged_attention.py ``--prefill`` measures it against the FLOPs floor).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import INTERPRETED, tl, triton

MAX_QUERY_LEN = 16  # rows per sequence the tile is built for (decode: 1, verify: k+1)
MAX_TILE_ROWS = 128  # Tq * G, padded: larger tiles spill registers at D = 256
PROGRAMS_PER_SM = 2  # target grid of the split kernel: two programs in flight per SM hide more load latency
MIN_SPLIT_LEN = 64  # shorter splits cost more in the merge (more partials per row) than they gain
MERGE_SPLITS = 64  # splits the merge reads in one tile
# shared memory the prefill kernel's default tiles may take for Q and the staged K/V tiles: the device's most per
# block less SMEM_MARGIN for the compiler's own layout conversions (an H100: 227 - 32 KB, so 128 x 64 tiles at
# D = 256 and two stages, the fastest of the tile sweep: bench/results/2026-12-07e-h100-serve-prefill/); off CUDA,
# PREFILL_SMEM
PREFILL_SMEM = 160 * 1024
SMEM_MARGIN = 32 * 1024


@functools.lru_cache(maxsize=None)
def _prefill_smem(device: torch.device) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"] - SMEM_MARGIN
    return PREFILL_SMEM


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter (the tests pass split_len to get several splits)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _check_shapes(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                  cu_seqlens: Tensor, positions: Tensor, page_size: int) -> tuple[int, int, int]:
    if q.dim() != 3 or key_cache.dim() != 3:
        raise ValueError(f"q {list(q.shape)}, key_cache {list(key_cache.shape)}: expected [N, H, D] and [S, Hkv, D]")
    rows, heads, dim = q.shape
    kv_heads = key_cache.shape[1]
    if heads % kv_heads or key_cache.shape[2] != dim or value_cache.shape != key_cache.shape:
        raise ValueError(f"q {list(q.shape)}, key_cache {list(key_cache.shape)}, value_cache "
                         f"{list(value_cache.shape)}: expected [N, H, D] and [S, Hkv, D] twice with Hkv dividing H")
    batch = cu_seqlens.shape[0] - 1
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables {list(block_tables.shape)}, context_lens {list(context_lens.shape)}: "
                         f"expected [{batch}, P] and [{batch}] for cu_seqlens of {batch + 1} entries")
    if positions.shape != (rows,):
        raise ValueError(f"positions {list(positions.shape)}: expected [{rows}]")
    if page_size < 1:
        raise ValueError(f"page_size={page_size}: expected a positive integer")
    return batch, heads, kv_heads


def split_kernel_fits(max_query_len: int, group: int) -> bool:
    """Whether a step of ``max_query_len`` rows per sequence and G = ``group`` fits the split kernel's tile."""
    return 1 <= max_query_len <= MAX_QUERY_LEN and _pow2(max(16, max_query_len * group)) <= MAX_TILE_ROWS


def _check(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
           cu_seqlens: Tensor, positions: Tensor, max_query_len: int, page_size: int) -> tuple[int, int, int]:
    batch, heads, kv_heads = _check_shapes(q, key_cache, value_cache, block_tables, context_lens, cu_seqlens,
                                           positions, page_size)
    if not 1 <= max_query_len <= MAX_QUERY_LEN:
        raise ValueError(f"max_query_len={max_query_len}: expected 1 .. {MAX_QUERY_LEN} (decode and verify steps)")
    if not split_kernel_fits(max_query_len, heads // kv_heads):
        raise ValueError(f"max_query_len={max_query_len} x {heads // kv_heads} query heads per KV head exceeds the "
                         f"{MAX_TILE_ROWS}-row tile")
    return batch, heads, kv_heads


def plan_splits(num_seqs: int, kv_heads: int, max_context: int, tile_rows: int, block_n: int,
                device: torch.device) -> int:
    """``split_len``: keys per program, a power of two >= ``block_n``.

    About ``PROGRAMS_PER_SM * SMs`` programs over ``num_seqs * kv_heads`` (sequence, KV head)
    pairs, but no fewer than ``MIN_SPLIT_LEN`` and ``tile_rows`` keys per split, so that a split's partial
    output (``tile_rows * D`` fp32) is at most the bf16 K/V it reads (and stays in L2 for the merge).
    ``tile_rows`` rather than ``2 * tile_rows``: at verify tiles (64 rows, D = 256) the shorter splits are
    the faster (measured: bench/results/2026-12-01-h200-perf4/call2-pa_sweep.log).
    Host-side ints only.
    """
    wanted = max(1, PROGRAMS_PER_SM * _sm_count(device) // max(1, num_seqs * kv_heads))
    return max(block_n, MIN_SPLIT_LEN, _pow2(tile_rows), _pow2(-(-max_context // wanted)))


@dataclass(frozen=True)
class LaunchPlan:
    d_pad: int  # D padded to a power of two >= 16
    m_pad: int  # tile rows: max_query_len * G padded to a power of two >= 16
    block_n: int  # keys per chunk
    split_len: int  # keys per program
    num_splits: int  # programs per (sequence, KV head); 1: no merge
    num_warps: int


def launch_plan(num_seqs: int, heads: int, kv_heads: int, dim: int, max_query_len: int, max_context: int,
                device: torch.device, *, split_len: int | None = None, block_n: int | None = None,
                num_warps: int | None = None) -> LaunchPlan:
    """The kernels' tiles and grid for a step (defaults where an override is None); host-side ints only."""
    d_pad = max(16, _pow2(dim))
    m_pad = max(16, _pow2(max_query_len * (heads // kv_heads)))
    if block_n is None:
        block_n = 32 if d_pad >= 256 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n}: expected a power of two >= 16")
    if split_len is None:
        split_len = plan_splits(num_seqs, kv_heads, max_context, m_pad, block_n, device)
    if split_len < block_n or split_len % block_n:
        raise ValueError(f"split_len={split_len}: expected a positive multiple of block_n={block_n}")
    if num_warps is None:
        # tiles of up to 64 rows (decode, and a k = 7 verify of G <= 8) at 4 warps: the sweep's best at
        # 64 x 256 (measured: bench/results/2026-12-01-h200-perf4/call2-pa_sweep.log); larger tiles
        # keep about 64 fp32 accumulator registers per thread
        num_warps = 4 if m_pad <= 64 else min(16, m_pad * d_pad // (32 * 64))
    return LaunchPlan(d_pad, m_pad, block_n, split_len, max(1, -(-max_context // split_len)), num_warps)


# The online softmax's step (flash attention), shared by this module's two kernels and the draft's ring attention
# (draft/ring_attention.py). For one tile of keys, scores in base 2 (q . k D^-1/2 log2 e, -inf where not visible):
#     m_new = max(m, max_j s_j),   l = l 2^(m - m_new) + sum_j 2^(s_j - m_new),
#     acc = acc 2^(m - m_new) + sum_j 2^(s_j - m_new) v_j
# so after the last tile acc / l is the softmax-weighted sum of the values (a row that has seen nothing keeps 0 as
# its shift). fp32 inputs (IEEE) multiply in fp32; bf16/fp16 round the probabilities to v's dtype for the
# tensor-core product, with fp32 accumulation.


@triton.jit
def online_softmax_step(acc, m_i, l_i, scores, v, IEEE: tl.constexpr):
    """``scores [M, N]`` (base 2, -inf where not visible), ``v [N, D]``, running ``m_i, l_i [M]`` and ``acc
    [M, D]`` fp32. Returns ``(acc, m_new, l_i)``."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_pages", "num_splits", "split_len"])
def _split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, cu_ptr, pos_ptr, out_ptr, po_ptr, plse_ptr,
                  stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_on, stride_oh,
                  num_pages, num_splits, split_len, scale_log2,
                  GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                  M_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  DIRECT: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(cu_ptr + b)
    num_rows = tl.load(cu_ptr + b + 1) - row0
    limit = tl.minimum(tl.load(ctx_ptr + b), num_pages * PAGE_SIZE)  # keys past the block table do not exist
    start = split * split_len
    end = tl.minimum(start + split_len, limit)  # this program's keys: start .. end-1 (none when end <= start)

    m = tl.arange(0, M_PAD)  # tile row m: query row m // G of the sequence, query head kv * G + m % G
    row_in_seq = m // GROUP
    head = kv * GROUP + m % GROUP
    in_m = row_in_seq < num_rows
    rows = (row0 + row_in_seq).to(tl.int64)
    d = tl.arange(0, D_PAD)
    in_d = d < D
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=in_m[:, None] & in_d[None, :], other=0.0)
    query_pos = tl.load(pos_ptr + rows, mask=in_m, other=-1)  # -1: a tile row past the sequence sees nothing

    acc = tl.zeros([M_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([M_PAD], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([M_PAD], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    j = start  # a runtime bound: one compiled variant for every split length and context
    page = tl.load(bt_ptr + b * stride_bt + (j + n) // PAGE_SIZE, mask=j + n < end, other=-1)
    while j < end:
        t = j + n
        in_t = t < end
        # the next chunk's page ids now, so the K/V loads of each chunk wait on one memory round trip, not two
        page_next = tl.load(bt_ptr + b * stride_bt + (t + BLOCK_N) // PAGE_SIZE, mask=t + BLOCK_N < end, other=-1)
        readable = in_t & (page >= 0)
        slot = page.to(tl.int64) * PAGE_SIZE + t % PAGE_SIZE
        kv_mask = readable[:, None] & in_d[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kn + kv * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vn + kv * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        k, v = k.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty)  # as the torch form: in q's dtype
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        visible = readable[None, :] & (t[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores * scale_log2, -float("inf"))  # [M_PAD, BLOCK_N], base 2
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, scores, v, IEEE)
        page = page_next
        j += BLOCK_N

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(out_ptr + rows[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])
    else:
        # partials [B, Hkv, splits, M_PAD, (D_PAD)]; splits at or past the context are never read by the merge
        part = ((b * HKV + kv) * num_splits + split).to(tl.int64) * M_PAD + m
        keep = in_m & (start < limit)
        tl.store(plse_ptr + part, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), -float("inf")), mask=keep)
        tl.store(po_ptr + part[:, None] * D_PAD + d[None, :], o, mask=keep[:, None] & in_d[None, :])


@triton.jit(do_not_specialize=["num_pages", "num_splits", "split_len", "max_query_len"])
def _merge_kernel(po_ptr, plse_ptr, out_ptr, ctx_ptr, cu_ptr, stride_on, stride_oh, num_pages, num_splits, split_len,
                  max_query_len, GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                  M_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, S_CHUNK: tl.constexpr, D_BLOCK: tl.constexpr):
    b = tl.program_id(0) // max_query_len
    row_in_seq = tl.program_id(0) % max_query_len
    head = tl.program_id(1)
    d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
    row0 = tl.load(cu_ptr + b)
    in_row = row_in_seq < tl.load(cu_ptr + b + 1) - row0  # grid rows past the sequence's end store nothing
    limit = tl.minimum(tl.load(ctx_ptr + b), num_pages * PAGE_SIZE)
    active = tl.minimum(tl.cdiv(limit, split_len), num_splits)  # the splits that hold keys of this sequence
    active = tl.where(in_row, active, 0)
    kv = head // GROUP
    m = row_in_seq * GROUP + head % GROUP
    base = (b * HKV + kv).to(tl.int64) * num_splits

    # online over chunks of S_CHUNK splits: o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)
    s = tl.arange(0, S_CHUNK)
    acc = tl.zeros([D_BLOCK], dtype=tl.float32)
    top = tl.max(tl.full([S_CHUNK], -float("inf"), dtype=tl.float32), axis=0)  # loop-carried fp32 scalars
    total = tl.sum(tl.zeros([S_CHUNK], dtype=tl.float32), axis=0)
    c = active - active
    while c < active:
        in_s = c + s < active
        parts = (base + c + s) * M_PAD + m
        lse = tl.load(plse_ptr + parts, mask=in_s, other=-float("inf"))  # [S_CHUNK]
        top_new = tl.maximum(top, tl.max(lse, axis=0))
        top_safe = tl.where(top_new == -float("inf"), 0.0, top_new)  # nothing seen yet: every weight is 0
        alpha = tl.exp2(top - top_safe)
        weight = tl.exp2(lse - top_safe)
        o = tl.load(po_ptr + parts[:, None] * D_PAD + d[None, :], mask=in_s[:, None] & (d < D)[None, :], other=0.0)
        acc = acc * alpha + tl.sum(weight[:, None] * o, axis=0)
        total = total * alpha + tl.sum(weight, axis=0)
        top = top_new
        c += S_CHUNK
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (row0 + row_in_seq).to(tl.int64) * stride_on + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=(d < D) & in_row)


def paged_attention_decode(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, cu_seqlens: Tensor, positions: Tensor, *, max_query_len: int,
                           page_size: int, split_len: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None) -> Tensor:
    """Causal GQA attention of each row over its sequence's paged K/V (the module docstring's math).

    q ``[N, H, D]``; key_cache, value_cache ``[S, Hkv, D]`` flat slots; block_tables ``[B, P]``
    (-1 past a sequence's pages); context_lens ``[B]`` (0 for a padding sequence); cu_seqlens
    ``[B+1]``; positions ``[N]``. ``max_query_len`` (<= 16) and ``page_size`` are host-side ints.
    ``split_len`` (keys per program, a multiple of ``block_n``), ``block_n`` (keys per chunk, a power
    of two >= 16) and ``num_warps`` override the defaults (tests, the benchmark's sweep). Returns
    ``[N, H, D]`` in q's dtype.
    """
    batch, heads, kv_heads = _check(q, key_cache, value_cache, block_tables, context_lens, cu_seqlens, positions,
                                    max_query_len, page_size)
    rows, _, dim = q.shape
    out = torch.empty((rows, heads, dim), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    group = heads // kv_heads
    plan = launch_plan(batch, heads, kv_heads, dim, max_query_len, block_tables.shape[1] * page_size, q.device,
                       split_len=split_len, block_n=block_n, num_warps=num_warps)
    d_pad, m_pad, num_splits = plan.d_pad, plan.m_pad, plan.num_splits
    q = q if q.stride(-1) == 1 else q.contiguous()
    key_cache = key_cache if key_cache.stride(-1) == 1 else key_cache.contiguous()
    value_cache = value_cache if value_cache.stride(-1) == 1 else value_cache.contiguous()
    # integer inputs are read in whatever int dtype they come (no conversion kernel per layer)
    block_tables, context_lens, cu_seqlens, positions = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (block_tables, context_lens, cu_seqlens, positions))
    direct = num_splits == 1
    if direct:
        partial_o = partial_lse = out  # unused
    else:
        partial_o = torch.empty((batch, kv_heads, num_splits, m_pad, d_pad), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((batch, kv_heads, num_splits, m_pad), dtype=torch.float32, device=q.device)
    common = dict(GROUP=group, HKV=kv_heads, D=dim, D_PAD=d_pad, M_PAD=m_pad, PAGE_SIZE=page_size)
    _split_kernel[(batch, kv_heads, num_splits)](
        q, key_cache, value_cache, block_tables, context_lens, cu_seqlens, positions, out, partial_o, partial_lse,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
        value_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        block_tables.shape[1], num_splits, plan.split_len, dim ** -0.5 * math.log2(math.e), **common,
        BLOCK_N=plan.block_n, DIRECT=direct, IEEE=q.dtype == torch.float32, num_warps=plan.num_warps)
    if not direct:
        d_block = min(d_pad, 64)
        _merge_kernel[(batch * max_query_len, heads, d_pad // d_block)](
            partial_o, partial_lse, out, context_lens, cu_seqlens, out.stride(0), out.stride(1),
            block_tables.shape[1], num_splits, plan.split_len, max_query_len, **common, S_CHUNK=MERGE_SPLITS,
            D_BLOCK=d_block, num_warps=4)
    return out


@dataclass(frozen=True)
class PrefillPlan:
    d_pad: int  # D padded to a power of two >= 16
    block_m: int  # tile rows: block_m // heads_per_program query rows x heads_per_program query heads
    block_n: int  # keys per tile
    heads_per_program: int  # query heads of one KV head that share each K/V tile
    num_warps: int
    num_stages: int  # K/V tiles in flight (the compiled loop's software pipeline)


def prefill_plan(num_seqs: int, heads: int, kv_heads: int, dim: int, max_query_len: int, itemsize: int,
                 device: torch.device, *, block_m: int | None = None, block_n: int | None = None,
                 heads_per_program: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None) -> PrefillPlan:
    """The prefill kernel's tiles for a step (defaults where an override is None); host-side ints only.

    ``block_m`` 128 rows, or 64 where 128-row tiles would leave SMs idle (fewer programs than SMs: a 512-row
    chunk of 16 heads makes 64) or a 128-row Q tile would take over 64 KB (fp32 at D = 256); ``block_n`` the
    largest power of two in 16 .. 64 whose ``num_stages`` K and V tiles fit beside Q in the device's shared memory
    less ``SMEM_MARGIN`` (``PREFILL_SMEM`` off CUDA and for fp32; counted as Q's tile and ``num_stages`` K and V
    tiles: 192 KB at 128 x 64 keys, D = 256, bf16, two stages); ``heads_per_program`` the largest power of two
    dividing G (module docstring).
    """
    d_pad = max(16, _pow2(dim))
    group = heads // kv_heads
    num_stages = 2 if num_stages is None else num_stages
    if block_m is None:
        wide = num_seqs * max_query_len * heads >= 128 * _sm_count(device)
        block_m = 128 if wide and 128 * d_pad * itemsize <= 64 * 1024 else 64
    if block_n is None:
        # the device's budget was swept at 16-bit inputs only; fp32 tiles (the conformance lane) keep PREFILL_SMEM
        budget = _prefill_smem(device) if itemsize <= 2 else min(PREFILL_SMEM, _prefill_smem(device))
        room = (budget - block_m * d_pad * itemsize) // (2 * max(num_stages, 1) * d_pad * itemsize)
        block_n = min(64, max(16, 1 << max(room, 1).bit_length() - 1))
    if heads_per_program is None:
        heads_per_program = min(group & -group, block_m)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name}={value}: expected a power of two >= 16")
    if group % heads_per_program or heads_per_program & (heads_per_program - 1) or heads_per_program > block_m:
        raise ValueError(f"heads_per_program={heads_per_program}: expected a power of two dividing G={group}, "
                         f"at most block_m={block_m}")
    if num_warps is None:  # at most 128 fp32 accumulator registers per thread (ptxas: none spill at D = 256)
        num_warps = 8 if block_m * d_pad >= 8192 else 4
    return PrefillPlan(d_pad, block_m, block_n, heads_per_program, num_warps, num_stages)


@triton.jit
def _prefill_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, stride_kn, stride_vn, start, end, query_pos, d, in_d,
                  scale_log2, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  IEEE: tl.constexpr):
    """One K/V tile (keys start .. start+BLOCK_N-1, none at or past ``end``) into the online softmax."""
    t = start + tl.arange(0, BLOCK_N)
    page = tl.load(bt_row + t // PAGE_SIZE, mask=t < end, other=-1)
    readable = page >= 0
    slot = page.to(tl.int64) * PAGE_SIZE + t % PAGE_SIZE
    kv_mask = readable[:, None] & in_d[None, :]
    k = tl.load(k_base + slot[:, None] * stride_kn + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_base + slot[:, None] * stride_vn + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    if CAUSAL:
        visible = readable[None, :] & (t[None, :] <= query_pos[:, None])
    else:  # below the block's first row: every row sees every readable key
        visible = readable[None, :]
    scores = tl.where(visible, scores * scale_log2, -float("inf"))  # [BLOCK_M, BLOCK_N], base 2
    return online_softmax_step(acc, m_i, l_i, scores, v, IEEE)


@triton.jit(do_not_specialize=["num_pages"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, cu_ptr, pos_ptr, out_ptr,
                    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_on, stride_oh,
                    num_pages, scale_log2, GROUP: tl.constexpr, HPP: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr, COMPILED: tl.constexpr):
    # one program: BLOCK_M // HPP rows of sequence b times HPP (heads per program) query heads of one KV head
    head0 = tl.program_id(0) * HPP
    b = tl.program_id(1)
    block = tl.num_programs(2) - 1 - tl.program_id(2)  # latest rows first: they have the most keys
    kv = head0 // GROUP
    row0 = tl.load(cu_ptr + b)
    num_rows = tl.load(cu_ptr + b + 1) - row0

    m = tl.arange(0, BLOCK_M)  # tile row m: row block * BLOCK_M / HPP + m // HPP, head head0 + m % HPP
    row_in_seq = block * (BLOCK_M // HPP) + m // HPP
    head = head0 + m % HPP
    in_m = row_in_seq < num_rows  # none in a block past the sequence's rows: no keys, no stores
    rows = (row0 + row_in_seq).to(tl.int64)
    d = tl.arange(0, D_PAD)
    in_d = d < D
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=in_m[:, None] & in_d[None, :], other=0.0)
    query_pos = tl.load(pos_ptr + rows, mask=in_m, other=-1).to(tl.int32)

    limit = tl.minimum(tl.load(ctx_ptr + b), num_pages * PAGE_SIZE)  # keys past the block table do not exist
    end = tl.minimum(tl.max(query_pos, axis=0) + 1, limit)  # the block's last row sees keys 0 .. end-1
    # keys 0 .. whole-1 (whole tiles) every row of the block sees: below its first row's position
    whole = tl.minimum(tl.min(tl.where(in_m, query_pos, limit), axis=0) + 1, end) // BLOCK_N * BLOCK_N

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    k_base = k_ptr + kv * stride_kh
    v_base = v_ptr + kv * stride_vh
    if COMPILED:  # for loops: the compiler pipelines their K/V loads (num_stages); a while loop it does not
        for start in range(0, whole, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, stride_kn, stride_vn, start,
                                          whole, query_pos, d, in_d, scale_log2, PAGE_SIZE, BLOCK_N, False, IEEE)
        for start in range(whole, end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, stride_kn, stride_vn, start,
                                          end, query_pos, d, in_d, scale_log2, PAGE_SIZE, BLOCK_N, True, IEEE)
    else:  # the same tiles in while loops: the interpreter cannot take a runtime range bound (triton_compat)
        start = whole - whole
        while start < whole:
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, stride_kn, stride_vn, start,
                                          whole, query_pos, d, in_d, scale_log2, PAGE_SIZE, BLOCK_N, False, IEEE)
            start += BLOCK_N
        while start < end:
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, stride_kn, stride_vn, start,
                                          end, query_pos, d, in_d, scale_log2, PAGE_SIZE, BLOCK_N, True, IEEE)
            start += BLOCK_N

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])


def paged_attention_prefill(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                            context_lens: Tensor, cu_seqlens: Tensor, positions: Tensor, *, max_query_len: int,
                            page_size: int, **tiles) -> Tensor:
    """Causal GQA attention of each row over its sequence's paged K/V (the module docstring's math), by the
    flash-attention kernel: for steps of any number of rows per sequence (prefill chunks).

    Arguments as :func:`paged_attention_decode`'s, ``max_query_len`` (host-side) at least every sequence's
    row count; ``tiles`` override :func:`prefill_plan`'s defaults (``block_m``, ``block_n``,
    ``heads_per_program``, ``num_warps``, ``num_stages``: tests, the benchmark's sweep). Returns ``[N, H, D]``
    in q's dtype.
    """
    batch, heads, kv_heads = _check_shapes(q, key_cache, value_cache, block_tables, context_lens, cu_seqlens,
                                           positions, page_size)
    if max_query_len < 1:
        raise ValueError(f"max_query_len={max_query_len}: expected a positive integer")
    rows, _, dim = q.shape
    out = torch.empty((rows, heads, dim), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    plan = prefill_plan(batch, heads, kv_heads, dim, max_query_len, q.element_size(), q.device, **tiles)
    q = q if q.stride(-1) == 1 else q.contiguous()
    key_cache = key_cache if key_cache.stride(-1) == 1 else key_cache.contiguous()
    value_cache = value_cache if value_cache.stride(-1) == 1 else value_cache.contiguous()
    block_tables, context_lens, cu_seqlens, positions = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (block_tables, context_lens, cu_seqlens, positions))
    hp = plan.heads_per_program
    grid = (heads // hp, batch, triton.cdiv(max_query_len, plan.block_m // hp))
    _prefill_kernel[grid](
        q, key_cache, value_cache, block_tables, context_lens, cu_seqlens, positions, out,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
        value_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        block_tables.shape[1], dim ** -0.5 * math.log2(math.e), GROUP=heads // kv_heads, HPP=hp, D=dim,
        D_PAD=plan.d_pad, PAGE_SIZE=page_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        IEEE=q.dtype == torch.float32, COMPILED=not INTERPRETED, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    return out


def paged_attention_triton(q: Tensor, key_cache: Tensor, value_cache: Tensor, meta, **tuning) -> Tensor:
    """:func:`paged_attention_torch`'s arguments and result, by the kernels: the split-KV pair for steps whose
    rows fit its tile (decode, verify; :func:`split_kernel_fits`), the prefill kernel for longer ones.

    ``meta`` is the step's :class:`~dflash2.fast.model.step.StepMeta` (its ``block_tables``,
    ``context_lens``, ``cu_seqlens``, ``positions``, ``max_query_len`` and ``page_size``). ``tuning`` goes to
    the kernel that runs (:func:`paged_attention_decode`'s or :func:`paged_attention_prefill`'s overrides).
    """
    launch = (paged_attention_decode if split_kernel_fits(meta.max_query_len, q.shape[1] // key_cache.shape[1])
              else paged_attention_prefill)
    return launch(q, key_cache, value_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens, meta.positions,
                  max_query_len=meta.max_query_len, page_size=meta.page_size, **tuning)


def paged_attention_torch(q: Tensor, key_cache: Tensor, value_cache: Tensor, meta) -> Tensor:
    """Causal GQA attention of each row over its sequence's paged K/V.

    q: ``[N, H, D]``; key_cache, value_cache: ``[S, Hkv, D]`` flat slots (S may include the trash
    row); ``meta`` the step's ``StepMeta``. Row n attends keys t of its sequence with ``t < context_len``
    and ``t <= position``. Scores and softmax in fp32. Returns ``[N, H, D]`` in q's dtype. Slots outside
    the context are zeroed before use, so whatever they hold (NaN poison included) cannot leak in.
    """
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], key_cache.shape[1]
    groups = heads // kv_heads
    valid = meta.kv_valid[:, :, None, None]  # [B, Tctx, 1, 1]
    keys = torch.where(valid, key_cache[meta.kv_gather], 0.0).to(q.dtype)  # [B, Tctx, Hkv, D]
    values = torch.where(valid, value_cache[meta.kv_gather], 0.0).to(q.dtype)  # [B, Tctx, Hkv, D]
    q_pad = meta.pad(q).view(meta.num_seqs, meta.max_query_len, kv_heads, groups, head_dim)  # [B, Tq, Hkv, G, D]

    scores = torch.einsum("bqhgd,bkhd->bhgqk", q_pad, keys).float() * head_dim ** -0.5  # [B, Hkv, G, Tq, Tctx]
    key_positions = torch.arange(keys.shape[1], device=q.device)
    visible = meta.kv_valid[:, None, :] & (key_positions[None, None, :] <= meta.query_positions[:, :, None])
    visible = visible[:, None, None]  # [B, 1, 1, Tq, Tctx]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)  # padded query rows see nothing
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs.to(values.dtype), values)  # [B, Tq, Hkv, G, D]
    return meta.unpad(out.reshape(meta.num_seqs, meta.max_query_len, heads, head_dim))


# every step on CUDA runs a kernel: decode and verify the split-KV pair, prefill chunks the prefill kernel
paged_attention = KernelOp("paged_attention", paged_attention_torch, GpuForm(
    paged_attention_triton, fits=lambda q, key_cache, value_cache, meta: meta.max_query_len >= 1))
