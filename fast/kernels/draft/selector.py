"""The candidate selector walk for B requests, twin of ``reference/speculative/selector.py``.

For request b and slot i = 1..k (draft row i, logits row i-1)::

    C_i = top-K_sel ids of z_i (logit desc, id asc),  U_i = z_i[C_i]
    g_i = P h_i
    sigma_i[j] = U_i[j] + sum_r A[y_{i-1}, r] g_i[r] Bc[C_i[j], r]          y_0 = the anchor token
    greedy: j* = argmax sigma_i (lowest index);   sampled: q_i = softmax(sigma_i / T) (fp32),
            j* = smallest j with cumsum(q_i)[j] > u_i * sum(q_i) (fp64), u_i = uniform(seed, s, SELECTOR, i)
    y_i = C_i[j*]

Two implementations with one result type (``SelectorBatch``):
- ``select_torch``: the candidates by ``top_candidates_torch`` (a top-k over unique int64 order keys,
  not a sort of the vocabulary) and the walk batched over requests (the loop is over the k <= S-1
  slots, which depend on each other). With ``all_greedy`` (the host knows every request is greedy)
  the walk skips the softmax and the keyed draws: the same picks, one-hot q.
- ``select_triton``: four kernels, over the twin's int64 keys (unique, ordered as (logit desc, id asc)),
  so each of the K_sel extraction rounds is one max reduction. (1) block top-K: each program takes
  BLOCK_V logits of one row and keeps the keys of its K_sel best; (2) merge: programs pick the K_sel
  largest of the block winners' keys, in two levels past ``MERGE_BLOCKS`` blocks (groups of blocks in
  parallel, then one program per row over the groups' winners), and the last level decodes the ids and
  values (``top_candidates_triton``, bit for bit the twin's);
  (3) g = h P^T for the k slots (``project_triton``: fp32 sums in one fixed order, no split of C);
  (4) walk: one program per request runs the k slots on [K_sel, r] tiles, with the keyed draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose

from ..common.pdl import launch_options, pdl_enabled
from ..sampling.philox import keyed_uniform_torch, philox_uniform
from ..sampling.sampler import draw_torch
from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

_SELECTOR = tl.constexpr(int(Purpose.SELECTOR))
# blocks whose winners one program of the first merge level takes: 16 x 16 = 256 entries, so the
# released vocabulary (243 blocks of 1024) merges as 16 + 1 programs per row instead of one program
# walking 4096 entries 16 times, a serial walk far slower than the merge's bytes (measured:
# bench/results/2026-12-01-h200-perf3/call2-trace-qwen3.5-35b-a3b-dflash7.txt)
MERGE_BLOCKS = 16


@dataclass(frozen=True)
class SelectorBatch:
    tokens: Tensor  # [B, k] long: y_1 .. y_k
    cand_ids: Tensor  # [B, k, K_sel] long: C_i
    draft_probs: Tensor  # [B, k, K_sel] fp32: q_i over C_i (greedy: one-hot at the pick)
    sigma: Tensor  # [B, k, K_sel] fp32: the edge scores


def _check(draft_logits: Tensor, hidden: Tensor, k: int, top_k: int) -> None:
    batch, rows, vocab = draft_logits.shape
    if hidden.shape[:2] != (batch, rows + 1):
        raise ValueError(f"hidden {list(hidden.shape)}: expected [{batch}, {rows + 1}, C] for logits "
                         f"{list(draft_logits.shape)}")
    if not 1 <= k <= rows:
        raise ValueError(f"k={k}: expected 1 .. {rows} (the block's draft rows)")
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k={top_k}: expected 1 .. {vocab}")


_INT32_MAX = 2**31 - 1


def top_candidates_torch(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The top_k logits of each row in (logit desc, id asc) order: exactly the first top_k of a stable
    descending sort (NaN first, -0.0 and 0.0 one value)  # [..., V] -> (values fp32, ids long) [..., top_k].

    Each token gets a unique int64 key ``ord(x) * 2^31 + (2^31 - 1 - id)``, ord the fp32 bits as an
    int32 that increases with x, so one ``torch.topk`` of the keys has no ties to break.
    """
    x = logits.float()
    bits = (x + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    order = torch.where(bits < 0, bits ^ _INT32_MAX, bits)  # negative floats: flip the magnitude bits
    order = torch.where(torch.isnan(x), _INT32_MAX, order)  # every NaN above +inf, as torch.sort ranks them
    ids = torch.arange(x.shape[-1], device=x.device)
    keys = (order.long() << 31) + (_INT32_MAX - ids)
    top = torch.topk(keys, top_k, dim=-1).indices
    return x.gather(-1, top), top


def select_torch(draft_logits: Tensor, hidden: Tensor, projection: Tensor, predecessor_codebook: Tensor,
                 successor_codebook: Tensor, anchor_tokens: Tensor, k: int, top_k: int, temperature: Tensor,
                 greedy: Tensor, seeds: Tensor, anchor_positions: Tensor, all_greedy: bool = False) -> SelectorBatch:
    """draft_logits [B, S-1, V], hidden [B, S, C], projection [r, C], codebooks [V, r], anchor_tokens,
    temperature (fp32), greedy (bool), seeds (int64 bits), anchor_positions: each [B]; k slots, K_sel = top_k.
    ``all_greedy``: the host knows ``greedy`` is all true (``HostSummary``), so no draw is made."""
    _check(draft_logits, hidden, k, top_k)
    batch = draft_logits.shape[0]
    device = draft_logits.device
    unary, cand_ids = top_candidates_torch(draft_logits[:, :k], top_k)  # [B, k, K]
    projected = hidden[:, 1:k + 1].float() @ projection.float().T  # [B, k, r]
    successors = successor_codebook.float()[cand_ids]  # [B, k, K, r]
    temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    tokens, probs, sigmas = [], [], []
    prev = anchor_tokens.long()
    rows = torch.arange(batch, device=device)
    for i in range(k):
        pred = predecessor_codebook.float()[prev] * projected[:, i]  # [B, r]
        sigma = unary[:, i] + (successors[:, i] @ pred[:, :, None])[..., 0]  # [B, K]
        if all_greedy:
            pick = torch.argmax(sigma, dim=-1)
            probs.append(torch.zeros_like(sigma).scatter_(-1, pick[:, None], 1.0))
        else:
            q = torch.softmax(sigma / temperature[:, None], dim=-1)
            u = keyed_uniform_torch(seeds, anchor_positions, int(Purpose.SELECTOR), i + 1)
            pick = torch.where(greedy, torch.argmax(sigma, dim=-1), draw_torch(q, u))
            one_hot = torch.zeros_like(q).scatter_(-1, pick[:, None], 1.0)
            probs.append(torch.where(greedy[:, None], one_hot, q))
        prev = cand_ids[rows, i, pick]
        tokens.append(prev)
        sigmas.append(sigma)
    return SelectorBatch(torch.stack(tokens, dim=1), cand_ids, torch.stack(probs, dim=1), torch.stack(sigmas, dim=1))


# -- Triton ---------------------------------------------------------------------------------------

# An entry of the block and merge kernels is the twin's int64 key ``ord(x) * 2^31 + (2^31 - 1 - id)``: unique
# per token and ordered as (logit desc, id asc), so each of the K_sel extraction rounds is ONE tl.max over the
# keys, which gives the value and the id at once (it was a max of the values, then a min of the ids equal to
# it, and in the merge a third reduction to fetch the id), and removing the pick is ``keys == best`` (no
# other token has that key). _EMPTY, below every token's key (ord(-inf) * 2^31 > -2^62), fills the lanes
# past the vocabulary and the picks made from an exhausted set; a row's top_k <= V picks are never _EMPTY.
_EMPTY = tl.constexpr(-2**63)
_LOW31 = tl.constexpr(_INT32_MAX)


@triton.jit
def _order_keys(x, ids, valid):
    """The keys of ``top_candidates_torch`` for fp32 ``x`` at int32 ``ids``; _EMPTY where not ``valid``."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into 0.0: one value, one key per id
    order = tl.where(bits < 0, bits ^ _LOW31, bits)  # negative floats: flip the magnitude bits
    order = tl.where(x != x, _LOW31, order)  # every NaN above +inf, as torch.sort ranks them
    keys = (order.to(tl.int64) << 31) + (ids ^ _LOW31).to(tl.int64)  # 2^31 - 1 - id, as 0 <= id < 2^31
    return tl.where(valid, keys, _EMPTY)


@triton.jit
def _top_keys(keys, KSEL: tl.constexpr, KSEL_PAD: tl.constexpr):
    """The KSEL largest of ``keys`` in descending order, as [KSEL_PAD] (lanes past KSEL and picks past the last
    real key: _EMPTY). One reduction a round: the keys are unique, so the max is the one pick."""
    lanes = tl.arange(0, KSEL_PAD)
    top = tl.full([KSEL_PAD], _EMPTY, tl.int64)
    for j in tl.static_range(KSEL):
        best = tl.max(keys, axis=0)
        top = tl.where(lanes == j, best, top)
        keys = tl.where(keys == best, _EMPTY, keys)
    return top


@triton.jit
def _block_topk_kernel(logits_ptr, stride_b, stride_i, out_key_ptr, K: tl.constexpr, KSEL: tl.constexpr,
                       KSEL_PAD: tl.constexpr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (row, blk): the keys of the KSEL best logits of ids blk*BLOCK_V .. +BLOCK_V-1 of row b*K + i,
    written at ``(row * NUM_BLOCKS + blk) * KSEL`` (a block with fewer real ids pads with _EMPTY)."""
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)  # b * K + i
    blk = tl.program_id(1)
    b, i = row // K, row % K
    ids = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = ids < VOCAB
    x = tl.load(logits_ptr + b.to(tl.int64) * stride_b + i * stride_i + ids, mask=valid, other=0.0).to(tl.float32)
    top = _top_keys(_order_keys(x, ids, valid), KSEL, KSEL_PAD)
    lanes = tl.arange(0, KSEL_PAD)
    tl.store(out_key_ptr + (row * NUM_BLOCKS + blk) * KSEL + lanes, top, mask=lanes < KSEL)


@triton.jit
def _merge_topk_kernel(key_ptr, out_key_ptr, cand_ptr, unary_ptr, logits_ptr, stride_b, stride_i, K: tl.constexpr,
                       KSEL: tl.constexpr, KSEL_PAD: tl.constexpr, ENTRIES: tl.constexpr, GROUP: tl.constexpr,
                       GROUP_PAD: tl.constexpr, FINAL: tl.constexpr, PDL: tl.constexpr):
    """Program (row, g): the KSEL largest of the row's keys g*GROUP .. (g+1)*GROUP-1 (of ENTRIES), written at
    ``(row * groups + g) * KSEL``: as keys to ``out_key_ptr`` for a later level, or with FINAL decoded into the
    ids (``cand_ptr``) and their logits (``unary_ptr``)."""
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    group = tl.program_id(1)
    lanes = tl.arange(0, GROUP_PAD)
    entry = group * GROUP + lanes
    keys = tl.load(key_ptr + row * ENTRIES + entry, mask=(lanes < GROUP) & (entry < ENTRIES), other=_EMPTY)
    top = _top_keys(keys, KSEL, KSEL_PAD)
    out_lanes = tl.arange(0, KSEL_PAD)
    in_k = out_lanes < KSEL
    out = (row * tl.num_programs(1) + group) * KSEL + out_lanes
    if FINAL:
        ids = (top & _LOW31) ^ _LOW31  # 2^31 - 1 - low 31 bits
        order = (top >> 31).to(tl.int32)
        unary = tl.where(order < 0, order ^ _LOW31, order).to(tl.float32, bitcast=True)
        # the key is the logit's bits except for -0.0 (keyed as 0.0) and NaN (one key for every NaN): read those
        # few back from the row, so the values are bit for bit the twin's gather (a lane masked off reads nothing)
        reread = in_k & ((order == 0) | (order == _LOW31)) & (top != _EMPTY)
        b, i = row // K, row % K
        exact = tl.load(logits_ptr + b.to(tl.int64) * stride_b + i * stride_i + ids, mask=reread, other=0.0)
        tl.store(cand_ptr + out, ids, mask=in_k)
        tl.store(unary_ptr + out, tl.where(reread, exact.to(tl.float32), unary), mask=in_k)
    else:
        tl.store(out_key_ptr + out, top, mask=in_k)


@triton.jit
def _project_kernel(hidden_ptr, stride_hb, stride_hs, stride_hc, proj_ptr, stride_p, out_ptr, K: tl.constexpr,
                    K_PAD: tl.constexpr, RANK: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Program (b, t): g[b, i, n] = sum_c P[n, c] h[b, i + 1, c] for the k slots i and BLOCK_R columns
    n = t*BLOCK_R .., in fp32 (h ``[B, S, C]`` and P ``[RANK, C]`` in their dtypes, converted exactly), into g
    ``[B, k, RANK]`` contiguous. Each program reads its slice of P once for all k rows, and all of C: no split
    to sum, so one fixed order (a [K_PAD, BLOCK_R, BLOCK_C] fp32 accumulator over C in BLOCK_C steps, then one
    tree over its lanes) and no float atomic; request b's g reads request b's rows only, whatever B is."""
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, K_PAD)
    c = tl.arange(0, BLOCK_C)
    h_rows = hidden_ptr + b.to(tl.int64) * stride_hb + (i[:, None, None] + 1) * stride_hs  # [K_PAD, 1, 1]
    p_rows = proj_ptr + n[None, :, None] * stride_p  # [1, BLOCK_R, 1]
    in_i = (i < K)[:, None, None]
    in_n = (n < RANK)[None, :, None]
    acc = tl.zeros([K_PAD, BLOCK_R, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, HIDDEN, BLOCK_C):
        cc = c0 + c[None, None, :]
        in_c = cc < HIDDEN
        h = tl.load(h_rows + cc * stride_hc, mask=in_i & in_c, other=0.0).to(tl.float32)  # [K_PAD, 1, BLOCK_C]
        w = tl.load(p_rows + cc, mask=in_n & in_c, other=0.0).to(tl.float32)  # [1, BLOCK_R, BLOCK_C]
        acc += h * w
    g = tl.sum(acc, axis=2)  # [K_PAD, BLOCK_R]
    tl.store(out_ptr + (b * K + i[:, None]) * RANK + n[None, :], g, mask=(i < K)[:, None] & (n < RANK)[None, :])


@triton.jit
def _walk_kernel(cand_ptr, unary_ptr, proj_ptr, pred_ptr, succ_ptr, anchor_tok_ptr, temperature_ptr, greedy_ptr,
                 seed_ptr, anchor_pos_ptr, tokens_ptr, probs_ptr, sigma_ptr, K: tl.constexpr, K_PAD: tl.constexpr,
                 KSEL: tl.constexpr, KSEL_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
                 PDL: tl.constexpr):
    """Program b: the k slots of request b in order. C_i, U_i ``[B, k, KSEL]``, g ``[B, k, RANK]`` fp32 (rows
    contiguous); codebooks A, Bc ``[V, RANK]`` (rows contiguous) -> y ``[B, k]``, q and sigma ``[B, k, KSEL]``."""
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    lanes = tl.arange(0, KSEL_PAD)
    in_k = lanes < KSEL
    rk = tl.arange(0, RANK_PAD)
    in_r = rk < RANK
    greedy = tl.load(greedy_ptr + b) != 0
    temperature = tl.where(greedy, 1.0, tl.load(temperature_ptr + b))
    seed = tl.load(seed_ptr + b)
    anchor_pos = tl.load(anchor_pos_ptr + b)
    prev = tl.load(anchor_tok_ptr + b)
    slots = tl.arange(0, K_PAD)
    uniforms = philox_uniform(seed, anchor_pos + 0 * slots, _SELECTOR, slots + 1).to(tl.float64)  # u_1..u_k
    # slot i's candidates, unaries, g and successor rows do not depend on y_{i-1}: slot i issues slot i+1's loads
    # (the ids with its own A[y_{i-1}] gather, their Bc rows once its stores are out), so each slot waits on
    # about one memory latency where the chain C_i -> Bc[C_i] and A[y_{i-1}] cost two (other load orders:
    # bench/results/2026-12-04-h200-perf13/README.md).
    cand = tl.load(cand_ptr + b * K * KSEL + lanes, mask=in_k, other=0)
    unary = tl.load(unary_ptr + b * K * KSEL + lanes, mask=in_k, other=0.0)
    g = tl.load(proj_ptr + b * K * RANK + rk, mask=in_r, other=0.0)
    succ = tl.load(succ_ptr + cand[:, None] * RANK + rk[None, :], mask=in_k[:, None] & in_r[None, :], other=0.0)
    for i in range(K):
        row = b * K + i
        pred = tl.load(pred_ptr + prev * RANK + rk, mask=in_r, other=0.0).to(tl.float32) * g
        more = i + 1 < K
        next_cand = tl.load(cand_ptr + (row + 1) * KSEL + lanes, mask=in_k & more, other=0)
        next_unary = tl.load(unary_ptr + (row + 1) * KSEL + lanes, mask=in_k & more, other=0.0)
        next_g = tl.load(proj_ptr + (row + 1) * RANK + rk, mask=in_r & more, other=0.0)
        sigma = unary + tl.sum(succ.to(tl.float32) * pred[None, :], axis=1)
        sigma = tl.where(in_k, sigma, -float("inf"))
        top = tl.max(sigma, axis=0)
        z = tl.math.div_rn(sigma, temperature)
        e = tl.exp(z - tl.max(z, axis=0))
        q = e / tl.sum(e, axis=0)
        u = tl.sum(tl.where(slots == i, uniforms, 0.0), axis=0)
        q64 = q.to(tl.float64)
        cdf = tl.cumsum(q64, axis=0)
        drawn = tl.min(tl.where(cdf > u * tl.sum(q64, axis=0), lanes, KSEL_PAD), axis=0)
        drawn = tl.minimum(drawn, tl.max(tl.where(q > 0.0, lanes, -1), axis=0))
        pick = tl.where(greedy, tl.min(tl.where(sigma == top, lanes, KSEL_PAD), axis=0), drawn)
        q = tl.where(greedy, tl.where(lanes == pick, 1.0, 0.0), q)
        prev = tl.sum(tl.where(lanes == pick, cand, 0), axis=0)
        tl.store(tokens_ptr + row, prev)
        tl.store(probs_ptr + row * KSEL + lanes, q, mask=in_k)
        tl.store(sigma_ptr + row * KSEL + lanes, sigma, mask=in_k)
        succ = tl.load(succ_ptr + next_cand[:, None] * RANK + rk[None, :], mask=(in_k & more)[:, None] & in_r[None, :],
                       other=0.0)
        cand, unary, g = next_cand, next_unary, next_g


def _key_warps(n: int) -> int:
    """Warps for a program that extracts from n keys: 8 keys (16 registers) a thread, 1 to 4 warps. A block of
    1024 logits keeps the default 4; the merges' 256 keys get 1 warp, whose rounds are shuffles only (4 warps
    add two shared-memory exchanges and three barriers a round; at the released shape the merges launch 112
    and 7 programs, latency-bound). The picks are the same for any count: an int64 max is exact."""
    return min(4, max(1, n // 256))


def top_candidates_triton(logits: Tensor, top_k: int, block_v: int | None = None) -> tuple[Tensor, Tensor]:
    """``top_candidates_torch`` by the block and merge kernels (values and ids bit for bit), for logits
    ``[B, R, V]`` (any strides but the last) -> (values fp32, ids long) ``[B, R, top_k]``."""
    batch, k, vocab = logits.shape
    device = logits.device
    cand_ids = torch.empty((batch, k, top_k), dtype=torch.int64, device=device)
    unary = torch.empty((batch, k, top_k), dtype=torch.float32, device=device)
    if cand_ids.numel() == 0:
        return unary, cand_ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ksel_pad = max(2, triton.next_power_of_2(top_k))
    block_v = block_v or max(min(1024, triton.next_power_of_2(vocab)), ksel_pad)
    num_blocks = triton.cdiv(vocab, block_v)
    rows = batch * k
    strides = dict(stride_b=logits.stride(0), stride_i=logits.stride(1))
    sizes = dict(K=k, KSEL=top_k, KSEL_PAD=ksel_pad, PDL=pdl_enabled(device), **launch_options(device))
    keys = torch.empty((rows, num_blocks, top_k), dtype=torch.int64, device=device)
    _block_topk_kernel[(rows, num_blocks)](logits, out_key_ptr=keys, VOCAB=vocab, BLOCK_V=block_v,
                                           NUM_BLOCKS=num_blocks, num_warps=_key_warps(block_v), **strides, **sizes)
    entries = num_blocks * top_k
    if num_blocks > MERGE_BLOCKS:  # two levels: groups of MERGE_BLOCKS blocks in parallel, then their winners
        group = MERGE_BLOCKS * top_k
        groups = triton.cdiv(entries, group)
        group_keys = torch.empty((rows, groups, top_k), dtype=torch.int64, device=device)
        group_pad = triton.next_power_of_2(group)
        _merge_topk_kernel[(rows, groups)](keys, group_keys, cand_ids, unary, logits, ENTRIES=entries, GROUP=group,
                                           GROUP_PAD=group_pad, FINAL=False, num_warps=_key_warps(group_pad),
                                           **strides, **sizes)
        keys, entries = group_keys, groups * top_k
    entries_pad = triton.next_power_of_2(entries)
    _merge_topk_kernel[(rows, 1)](keys, keys, cand_ids, unary, logits, ENTRIES=entries, GROUP=entries,
                                  GROUP_PAD=entries_pad, FINAL=True, num_warps=_key_warps(entries_pad), **strides,
                                  **sizes)
    return unary, cand_ids


def project_triton(hidden: Tensor, projection: Tensor, k: int, block_r: int = 1,
                   block_c: int | None = None) -> Tensor:
    """g = h P^T for the walk's k slots: ``hidden[:, 1:k + 1].float() @ projection.float().T`` by one kernel
    (fp32 accumulation; it differs from the torch product only in the order of the sums)  # hidden [B, S, C]
    (any strides, read in place), projection [r, C] (any float dtype) -> [B, k, r] fp32 contiguous.

    One program per request and ``block_r`` columns of g; ``block_c`` defaults to keep the [K_PAD, block_r,
    block_c] accumulator at 8192 fp32 (64 a thread of 4 warps). Each program's C loop waits on its loads every
    step, so the kernel is latency-bound and narrow programs win: at the released shape (B = 1, k = 7, r = 256,
    C = 2048) ``block_r = 1`` (256 programs, 2 steps) is the fastest, with an fp32 P and with the draft's bf16 P
    as the proposer passes it, and faster than the torch form (an fp32 copy of h and a cuBLAS fp32 GEMM)
    (bench_draft_kernels.py, CUDA-graph replays, L2 flushed; measured:
    bench/results/2026-12-04-h200-perf13/c5-draft-kernels.log)."""
    batch, rows, hidden_size = hidden.shape
    rank = projection.shape[0]
    if projection.shape[1] != hidden_size:
        raise ValueError(f"projection {list(projection.shape)}: expected [r, {hidden_size}] for hidden "
                         f"{list(hidden.shape)}")
    if not 1 <= k <= rows - 1:
        raise ValueError(f"k={k}: expected 1 .. {rows - 1} (hidden rows 1 .. k)")
    out = torch.empty((batch, k, rank), dtype=torch.float32, device=hidden.device)
    if out.numel() == 0:
        return out
    projection = projection if projection.stride(-1) == 1 else projection.contiguous()
    k_pad = triton.next_power_of_2(k)
    block_r = min(block_r, triton.next_power_of_2(rank))
    block_c = block_c or max(16, min(triton.next_power_of_2(hidden_size), 8192 // (k_pad * block_r)))
    _project_kernel[(batch, triton.cdiv(rank, block_r))](
        hidden, hidden.stride(0), hidden.stride(1), hidden.stride(2), projection, projection.stride(0), out, K=k,
        K_PAD=k_pad, RANK=rank, HIDDEN=hidden_size, BLOCK_R=block_r, BLOCK_C=block_c,
        PDL=pdl_enabled(hidden.device), num_warps=4, **launch_options(hidden.device))
    return out


def select_triton(draft_logits: Tensor, hidden: Tensor, projection: Tensor, predecessor_codebook: Tensor,
                  successor_codebook: Tensor, anchor_tokens: Tensor, k: int, top_k: int, temperature: Tensor,
                  greedy: Tensor, seeds: Tensor, anchor_positions: Tensor, all_greedy: bool = False,
                  block_v: int | None = None) -> SelectorBatch:
    """``select_torch`` by the Triton kernels (same arguments and result; ``all_greedy`` is the torch walk's
    hint, unused here)."""
    _check(draft_logits, hidden, k, top_k)
    batch = draft_logits.shape[0]
    device = draft_logits.device
    rank = projection.shape[0]
    tokens = torch.empty((batch, k), dtype=torch.int64, device=device)
    probs = torch.empty((batch, k, top_k), dtype=torch.float32, device=device)
    sigma = torch.empty((batch, k, top_k), dtype=torch.float32, device=device)
    unary, cand_ids = top_candidates_triton(draft_logits[:, :k], top_k, block_v)
    if batch == 0:
        return SelectorBatch(tokens, cand_ids, probs, sigma)
    projected = project_triton(hidden, projection, k)  # [B, k, r] fp32: g_i = P h_i
    # greedy goes in as it comes (bool): the kernel reads it as != 0, so no int8 copy is launched
    _walk_kernel[(batch,)](cand_ids, unary, projected, predecessor_codebook.contiguous(),
                           successor_codebook.contiguous(), anchor_tokens.to(torch.int64).contiguous(),
                           temperature.float().contiguous(), greedy.contiguous(), seeds.contiguous(),
                           anchor_positions.to(torch.int64).contiguous(), tokens, probs, sigma, K=k,
                           K_PAD=max(2, triton.next_power_of_2(k)), KSEL=top_k,
                           KSEL_PAD=max(2, triton.next_power_of_2(top_k)), RANK=rank,
                           RANK_PAD=max(2, triton.next_power_of_2(rank)), PDL=pdl_enabled(device),
                           **launch_options(device))
    return SelectorBatch(tokens, cand_ids, probs, sigma)


# ``all_greedy`` (host knowledge) only shortens the torch walk; the Triton walk needs no hint
select = KernelOp("selector", select_torch, GpuForm(select_triton))
