"""The draft's window attention over the per-request K/V ring, twin of ``reference/model/draft.window_attention``.

B blocks of S rows; block b is anchored at s_b, its row i sits at s_b + i and reads

    context positions p in [s_b - W + 1, s_b - 1], p >= 0, with (s_b + i) - p < W     from the ring
    block rows j with |i - j| < W                                                   (all, for S <= W)

softmax(q . k * D^-1/2) in fp32, GQA (query head h reads KV head h // (H / Hkv)). Context rows come
from the ring pool ``[num_slots, capacity, Hkv, D]`` of the block's request, slot = p mod capacity;
positions outside the window are never read (masked loads, not zero weights), so whatever the other
slots hold (stale rows, NaN poison) cannot leak.

Layout at the boundary is token-major: q ``[B*S, H, D]``, block_k/block_v ``[B*S, Hkv, D]``; the
output is ``[B*S, H, D]`` in q's dtype.

``ring_attention_torch`` gathers the window rows and runs a masked softmax (CPU, or any device as
a fallback); on the CPU it gathers only from the first position >= 0 of the batch's latest anchor.

``ring_attention_triton`` is split-window ("flash-decoding", the structure of paged_attention.py),
two kernels with a grid fixed by the shapes (B, W) and the device's SM count, no host sync, no
atomics, so a CUDA-graph replay equals an eager call bit for bit:

1. ``_ring_split_kernel``, one program per (block, KV head, split of ``split_len`` context keys):
   the S * H/Hkv query rows of that group form one tile (S = 8, G = 4: 32 rows); split 0 also takes
   the block's own keys (every row sees them). The split's keys stream in ``block_n`` chunks with an
   online softmax (base 2); chunks wholly before position 0 are skipped. It writes the normalised
   partial output and its log-sum-exp (-inf, with o = 0, for a row that saw nothing in the split).
   ``split_len`` follows ``paged_attention.plan_splits``: about ``PROGRAMS_PER_SM`` programs per SM
   over the B * Hkv (block, KV head) pairs (at W = 2048, Hkv = 8: 32 splits of 64 keys at B = 1, 2
   of 1024 at B = 16).
2. ``_ring_merge_kernel``, one program per (block row, query head, D block of 64):
   ``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` over all splits, in split order.

With a single split the first kernel writes the output itself and the merge is not launched.
Bound: memory, ``W * Hkv * D * 2 * itemsize`` bytes of ring per block (8.4 MB at B = 1 for the 27B
draft, of the order of a launch's latency to read), so at small B the grid's width is what matters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention.paged_attention import MERGE_SPLITS, online_softmax_step, plan_splits
from ..common.pdl import launch_options, pdl_enabled
from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

LOG2E = math.log2(math.e)  # scores in base 2: exp(x) = exp2(x log2 e)


def _check(q: Tensor, block_k: Tensor, block_v: Tensor, ring_k: Tensor, ring_v: Tensor, ring_slots: Tensor,
           anchor_positions: Tensor, window: int) -> tuple[int, int]:
    batch = anchor_positions.shape[0]
    rows, heads, dim = q.shape
    if batch == 0 or rows % batch:
        raise ValueError(f"q has {rows} rows, not a multiple of B={batch} blocks")
    block = rows // batch
    kv_heads = block_k.shape[1]
    if heads % kv_heads or block_k.shape != (rows, kv_heads, dim) or block_v.shape != block_k.shape:
        raise ValueError(f"q {list(q.shape)}, block_k {list(block_k.shape)}, block_v {list(block_v.shape)}: "
                         f"expected [B*S, H, D] and [B*S, Hkv, D] with Hkv dividing H")
    if ring_k.dim() != 4 or ring_k.shape[2:] != (kv_heads, dim) or ring_v.shape != ring_k.shape:
        raise ValueError(f"ring pools {list(ring_k.shape)}/{list(ring_v.shape)}: expected [slots, capacity, "
                         f"{kv_heads}, {dim}]")
    if ring_k.shape[1] < window - 1:
        raise ValueError(f"ring capacity {ring_k.shape[1]} < W - 1 = {window - 1}: the window does not fit")
    if ring_slots.shape != (batch,):
        raise ValueError(f"ring_slots {list(ring_slots.shape)}: expected [{batch}]")
    return batch, block


def ring_attention_torch(q: Tensor, block_k: Tensor, block_v: Tensor, ring_k: Tensor, ring_v: Tensor,
                         ring_slots: Tensor, anchor_positions: Tensor, window: int,
                         scale: float | None = None) -> Tensor:
    """q [B*S, H, D], block_k/v [B*S, Hkv, D], ring_k/v [num_slots, capacity, Hkv, D], ring_slots and
    anchor_positions [B]; scale defaults to D^-1/2. Returns [B*S, H, D] in q's dtype."""
    batch, block = _check(q, block_k, block_v, ring_k, ring_v, ring_slots, anchor_positions, window)
    _, heads, dim = q.shape
    kv_heads, capacity = block_k.shape[1], ring_k.shape[1]
    group = heads // kv_heads
    device = q.device
    ctx = window - 1
    # On the CPU the anchors are host values: skip the leading t that lie before position 0 in every
    # block (a short context reads a few rows, not W-1). Masked rows weigh exactly 0, so this only
    # shortens the softmax; elsewhere the full window keeps the shapes free of host reads.
    first = max(0, ctx - int(anchor_positions.max())) if anchor_positions.device.type == "cpu" else 0
    t = torch.arange(first, ctx, device=device)
    ctx_pos = anchor_positions[:, None] - ctx + t[None, :]  # [B, T] with T = W-1-first
    readable = ctx_pos >= 0
    slot = torch.remainder(ctx_pos, capacity)
    ctx_k = ring_k[ring_slots[:, None], slot].float()  # [B, T, Hkv, D]
    ctx_v = ring_v[ring_slots[:, None], slot].float()
    ctx_k = torch.where(readable[..., None, None], ctx_k, 0.0)
    ctx_v = torch.where(readable[..., None, None], ctx_v, 0.0)
    keys = torch.cat([ctx_k, block_k.float().reshape(batch, block, kv_heads, dim)], dim=1)  # [B, N, Hkv, D]
    values = torch.cat([ctx_v, block_v.float().reshape(batch, block, kv_heads, dim)], dim=1)

    i = torch.arange(block, device=device)
    ctx_seen = readable[:, None, :] & (t[None, None, :] >= i[None, :, None])  # (s+i) - p < W  <=>  t >= i
    blk_seen = ((i[:, None] - i[None, :]).abs() < window).expand(batch, block, block)
    seen = torch.cat([ctx_seen, blk_seen], dim=-1)  # [B, S, N]

    queries = q.float().reshape(batch, block, kv_heads, group, dim)
    scale = dim ** -0.5 if scale is None else scale
    scores = torch.einsum("bikgd,bnkd->bkgin", queries, keys) * scale  # [B, Hkv, G, S, N]
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgin,bnkd->bikgd", weights, values)  # [B, S, Hkv, G, D]
    return out.reshape(batch * block, heads, dim).to(q.dtype)


# -- Triton ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RingPlan:
    m_pad: int  # tile rows: S * G padded to a power of two >= 16
    s_pad: int  # block keys: S padded
    d_pad: int  # D padded
    block_n: int  # context keys per chunk
    split_len: int  # context keys per program (a multiple of block_n)
    num_splits: int  # programs per (block, KV head); 1: no merge
    num_warps: int


def launch_plan(batch: int, heads: int, kv_heads: int, block: int, dim: int, window: int, device: torch.device, *,
                split_len: int | None = None, block_n: int = 64) -> RingPlan:
    """The kernels' tiles and grid for B blocks; host-side ints only (the shapes and the device's SM count)."""
    m_pad = max(16, triton.next_power_of_2(block * (heads // kv_heads)))
    d_pad = max(16, triton.next_power_of_2(dim))
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n}: expected a power of two >= 16")
    context = max(1, window - 1)
    if split_len is None:  # the target's rule: ~PROGRAMS_PER_SM programs per SM, splits of >= 2 * tile rows keys
        split_len = plan_splits(batch, kv_heads, context, m_pad, block_n, device)
    if split_len < block_n or split_len % block_n:
        raise ValueError(f"split_len={split_len}: expected a positive multiple of block_n={block_n}")
    return RingPlan(m_pad, max(16, triton.next_power_of_2(block)), d_pad, block_n, split_len, -(-context // split_len),
                    max(4, min(16, m_pad * d_pad // (32 * 64))))


@triton.jit
def _ring_split_kernel(q_ptr, bk_ptr, bv_ptr, rk_ptr, rv_ptr, ring_slot_ptr, anchor_ptr, out_ptr, po_ptr, plse_ptr,
                       stride_q, stride_bk, stride_bv, stride_ring_slot, stride_ring_row, scale_log2,
                       S: tl.constexpr, GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       WINDOW: tl.constexpr, CAPACITY: tl.constexpr, M_PAD: tl.constexpr, S_PAD: tl.constexpr,
                       D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    m = tl.arange(0, M_PAD)
    row_i = m // GROUP  # block row of each query row
    head = kv * GROUP + m % GROUP
    in_m = m < S * GROUP
    d = tl.arange(0, D_PAD)
    in_d = d < D
    q_rows = (b * S + row_i).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q + head[:, None] * D + d[None, :],
                mask=in_m[:, None] & in_d[None, :], other=0.0)

    acc = tl.zeros([M_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([M_PAD], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([M_PAD], dtype=tl.float32)
    if split == 0:  # the block's own rows (|i - j| < W: all of them when S <= W), in split 0 only
        j = tl.arange(0, S_PAD)
        in_j = j < S
        kv_rows = (b * S + j).to(tl.int64)
        k = tl.load(bk_ptr + kv_rows[:, None] * stride_bk + kv * D + d[None, :], mask=in_j[:, None] & in_d[None, :],
                    other=0.0)
        v = tl.load(bv_ptr + kv_rows[:, None] * stride_bv + kv * D + d[None, :], mask=in_j[:, None] & in_d[None, :],
                    other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        else:
            scores = tl.dot(q, tl.trans(k)) * scale_log2
        near = (row_i[:, None] - j[None, :] < WINDOW) & (j[None, :] - row_i[:, None] < WINDOW)
        scores = tl.where(in_j[None, :] & near, scores, -float("inf"))
        m_i = tl.max(scores, axis=1)  # finite: every row sees the block
        p = tl.exp2(scores - m_i[:, None])
        l_i = tl.sum(p, axis=1)
        if IEEE:
            acc = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v)

    # this split's part of the context window: t = 0 .. W-2 is position s - W + 1 + t; row i reads t >= i and
    # positions >= 0
    anchor = tl.load(anchor_ptr + b)
    ring = tl.load(ring_slot_ptr + b).to(tl.int64)
    first = WINDOW - 1 - anchor  # the first t at position 0
    n = tl.arange(0, BLOCK_N)
    for c in range(0, SPLIT_LEN, BLOCK_N):
        t0 = split * SPLIT_LEN + c
        if (t0 + BLOCK_N > first) & (t0 < WINDOW - 1):  # chunks wholly before position 0 or past the window: skipped
            t = t0 + n
            pos = anchor - (WINDOW - 1) + t
            readable = (t < WINDOW - 1) & (pos >= 0)
            slot = tl.where(readable, pos % CAPACITY, 0)
            ring_offs = ring * stride_ring_slot + slot[:, None] * stride_ring_row + kv * D + d[None, :]
            ctx_k = tl.load(rk_ptr + ring_offs, mask=readable[:, None] & in_d[None, :], other=0.0)
            ctx_v = tl.load(rv_ptr + ring_offs, mask=readable[:, None] & in_d[None, :], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(ctx_k), input_precision="ieee") * scale_log2
            else:
                scores = tl.dot(q, tl.trans(ctx_k)) * scale_log2
            seen = readable[None, :] & (t[None, :] >= row_i[:, None])
            scores = tl.where(seen, scores, -float("inf"))
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, scores, ctx_v, IEEE)

    seen_any = l_i > 0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(out_ptr + q_rows[:, None] * (HKV * GROUP * D) + head[:, None] * D + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])
    else:
        # partials [B, Hkv, splits, M_PAD, (D_PAD)]: every split writes (log-sum-exp -inf, o = 0 where it saw nothing)
        part = ((b * HKV + kv) * NUM_SPLITS + split).to(tl.int64) * M_PAD + m
        tl.store(plse_ptr + part, tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), -float("inf")),
                 mask=in_m)
        tl.store(po_ptr + part[:, None] * D_PAD + d[None, :], o, mask=in_m[:, None] & in_d[None, :])


@triton.jit
def _ring_merge_kernel(po_ptr, plse_ptr, out_ptr, S: tl.constexpr, GROUP: tl.constexpr, HKV: tl.constexpr,
                       D: tl.constexpr, D_PAD: tl.constexpr, M_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       S_CHUNK: tl.constexpr, D_BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)  # b * S + i
    head = tl.program_id(1)
    d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
    b = row // S
    kv = head // GROUP
    m = (row % S) * GROUP + head % GROUP
    base = (b * HKV + kv).to(tl.int64) * NUM_SPLITS

    # online over chunks of S_CHUNK splits, in split order: o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)
    s = tl.arange(0, S_CHUNK)
    acc = tl.zeros([D_BLOCK], dtype=tl.float32)
    top = tl.max(tl.full([S_CHUNK], -float("inf"), dtype=tl.float32), axis=0)  # loop-carried fp32 scalars
    total = tl.sum(tl.zeros([S_CHUNK], dtype=tl.float32), axis=0)
    for c in range(0, NUM_SPLITS, S_CHUNK):
        in_s = c + s < NUM_SPLITS
        parts = (base + c + s) * M_PAD + m
        lse = tl.load(plse_ptr + parts, mask=in_s, other=-float("inf"))  # [S_CHUNK]
        top_new = tl.maximum(top, tl.max(lse, axis=0))  # finite from the first chunk on: split 0 saw the block
        alpha = tl.exp2(top - top_new)
        weight = tl.exp2(lse - top_new)
        o = tl.load(po_ptr + parts[:, None] * D_PAD + d[None, :], mask=in_s[:, None] & (d < D)[None, :], other=0.0)
        acc = acc * alpha + tl.sum(weight[:, None] * o, axis=0)
        total = total * alpha + tl.sum(weight, axis=0)
        top = top_new
    tl.store(out_ptr + row.to(tl.int64) * (HKV * GROUP * D) + head * D + d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=d < D)


def ring_attention_triton(q: Tensor, block_k: Tensor, block_v: Tensor, ring_k: Tensor, ring_v: Tensor,
                          ring_slots: Tensor, anchor_positions: Tensor, window: int, scale: float | None = None,
                          block_n: int = 64, split_len: int | None = None) -> Tensor:
    """``ring_attention_torch`` by the kernels (same arguments and result). ``block_n`` (context keys per
    chunk) and ``split_len`` (context keys per program, a multiple of block_n; default from
    :func:`launch_plan`) are tuning overrides (tests, benchmarks)."""
    batch, block = _check(q, block_k, block_v, ring_k, ring_v, ring_slots, anchor_positions, window)
    _, heads, dim = q.shape
    kv_heads = block_k.shape[1]
    group = heads // kv_heads
    q = q if q.stride(-1) == 1 and q.stride(-2) == dim else q.contiguous()
    # block K/V may be views into one projection (rows of stride 2 * Hkv * D): any row stride, packed heads
    block_k, block_v = (t if t.stride(-1) == 1 and t.stride(-2) == dim else t.contiguous() for t in (block_k, block_v))
    ring_k, ring_v = ring_k.contiguous(), ring_v.contiguous()
    plan = launch_plan(batch, heads, kv_heads, block, dim, window, q.device, split_len=split_len, block_n=block_n)
    out = torch.empty((q.shape[0], heads, dim), dtype=q.dtype, device=q.device)
    direct = plan.num_splits == 1
    if direct:
        partial_o = partial_lse = out  # unused
    else:
        partial_o = torch.empty((batch, kv_heads, plan.num_splits, plan.m_pad, plan.d_pad), dtype=torch.float32,
                                device=q.device)
        partial_lse = torch.empty((batch, kv_heads, plan.num_splits, plan.m_pad), dtype=torch.float32,
                                  device=q.device)
    common = dict(S=block, GROUP=group, HKV=kv_heads, D=dim, D_PAD=plan.d_pad, M_PAD=plan.m_pad,
                  NUM_SPLITS=plan.num_splits, PDL=pdl_enabled(q.device), **launch_options(q.device))
    _ring_split_kernel[(batch, kv_heads, plan.num_splits)](
        q, block_k, block_v, ring_k, ring_v, ring_slots.to(torch.int64).contiguous(),
        anchor_positions.to(torch.int64).contiguous(), out, partial_o, partial_lse, q.stride(0), block_k.stride(0),
        block_v.stride(0), ring_k.stride(0), ring_k.stride(1), (dim ** -0.5 if scale is None else scale) * LOG2E,
        WINDOW=window, CAPACITY=ring_k.shape[1], S_PAD=plan.s_pad, BLOCK_N=plan.block_n, SPLIT_LEN=plan.split_len,
        DIRECT=direct, IEEE=q.dtype == torch.float32, **common, num_warps=plan.num_warps)
    if not direct:
        d_block = min(plan.d_pad, 64)
        _ring_merge_kernel[(batch * block, heads, plan.d_pad // d_block)](
            partial_o, partial_lse, out, **common, S_CHUNK=min(MERGE_SPLITS, triton.next_power_of_2(plan.num_splits)),
            D_BLOCK=d_block, num_warps=4)
    return out


ring_attention = KernelOp("ring_attention", ring_attention_torch, GpuForm(ring_attention_triton))
