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
- ``select_triton``: three kernels. (1) block top-K: each program takes BLOCK_V logits of one row
  and extracts its K_sel best in (logit desc, id asc) order; (2) merge: programs pick the K_sel best
  of the block winners (equal logits come out in block order, which is id order), in two levels past
  ``MERGE_BLOCKS`` blocks (groups of blocks in parallel, then one program per row over the groups'
  winners, which are again in id order for equal logits);
  (3) walk: one program per request runs the k slots on [K_sel, r] tiles, with the keyed draw.
  g = h P^T is one GEMM before the walk (torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose

from .philox import keyed_uniform_torch, philox_uniform
from .sampler import draw_torch
from .triton_compat import tl, triton, use_triton

_SELECTOR = tl.constexpr(int(Purpose.SELECTOR))
# blocks whose winners one program of the first merge level takes: 16 x 16 = 256 entries, so the
# released vocabulary (243 blocks of 1024) merges as 16 + 1 programs per row instead of one program
# walking 4096 entries 16 times (39.5 us for 7 rows on an H200, perf3 call 2's trace)
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

@triton.jit
def _block_topk_kernel(logits_ptr, stride_b, stride_i, out_val_ptr, out_pos_ptr, K: tl.constexpr,
                       KSEL: tl.constexpr, KSEL_PAD: tl.constexpr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr,
                       NUM_BLOCKS: tl.constexpr):
    row = tl.program_id(0)  # b * K + i
    blk = tl.program_id(1)
    b, i = row // K, row % K
    ids = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(logits_ptr + b.to(tl.int64) * stride_b + i * stride_i + ids, mask=ids < VOCAB,
                other=-float("inf")).to(tl.float32)
    valid = ids < VOCAB
    lanes = tl.arange(0, KSEL_PAD)
    best_val = tl.full([KSEL_PAD], -float("inf"), tl.float32)
    best_id = tl.full([KSEL_PAD], VOCAB, tl.int32)
    for j in tl.static_range(KSEL):
        m = tl.max(tl.where(valid, x, -float("inf")), axis=0)
        pick = tl.min(tl.where(valid & (x == m), ids, VOCAB), axis=0)
        best_val = tl.where(lanes == j, m, best_val)
        best_id = tl.where(lanes == j, pick, best_id)
        valid = valid & (ids != pick)
    out = (row * NUM_BLOCKS + blk) * KSEL_PAD + lanes
    tl.store(out_val_ptr + out, best_val)
    tl.store(out_pos_ptr + out, best_id)


@triton.jit
def _merge_topk_kernel(val_ptr, id_ptr, cand_ptr, unary_ptr, KSEL: tl.constexpr, KSEL_PAD: tl.constexpr,
                       VOCAB: tl.constexpr, ENTRIES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr):
    """Program (row, g): the KSEL best of the row's entries g*GROUP .. (g+1)*GROUP-1 (of ENTRIES), written at
    ``(row * groups + g) * KSEL``; a pick with nothing left gets id VOCAB and -inf (which a later merge skips)."""
    row = tl.program_id(0)
    group = tl.program_id(1)
    lanes = tl.arange(0, GROUP_PAD)
    entry = group * GROUP + lanes
    avail = (lanes < GROUP) & (entry < ENTRIES)
    v = tl.load(val_ptr + row * ENTRIES + entry, mask=avail, other=-float("inf"))
    ids = tl.load(id_ptr + row * ENTRIES + entry, mask=avail, other=VOCAB)
    avail = avail & (ids < VOCAB)
    out_lanes = tl.arange(0, KSEL_PAD)
    cand = tl.zeros([KSEL_PAD], dtype=tl.int64)
    unary = tl.zeros([KSEL_PAD], dtype=tl.float32)
    for j in tl.static_range(KSEL):
        m = tl.max(tl.where(avail, v, -float("inf")), axis=0)
        pos = tl.min(tl.where(avail & (v == m), lanes, GROUP_PAD), axis=0)  # equal values: the lowest entry
        chosen = tl.where(pos < GROUP_PAD, tl.sum(tl.where(lanes == pos, ids, 0).to(tl.int64), axis=0), VOCAB)
        cand = tl.where(out_lanes == j, chosen, cand)
        unary = tl.where(out_lanes == j, m, unary)
        avail = avail & (lanes != pos)
    out = (row * tl.num_programs(1) + group) * KSEL + out_lanes
    tl.store(cand_ptr + out, cand, mask=out_lanes < KSEL)
    tl.store(unary_ptr + out, unary, mask=out_lanes < KSEL)


@triton.jit
def _walk_kernel(cand_ptr, unary_ptr, proj_ptr, pred_ptr, succ_ptr, anchor_tok_ptr, temperature_ptr, greedy_ptr,
                 seed_ptr, anchor_pos_ptr, tokens_ptr, probs_ptr, sigma_ptr, K: tl.constexpr, K_PAD: tl.constexpr,
                 KSEL: tl.constexpr, KSEL_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr):
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
    for i in range(K):
        row = b * K + i
        cand = tl.load(cand_ptr + row * KSEL + lanes, mask=in_k, other=0)
        unary = tl.load(unary_ptr + row * KSEL + lanes, mask=in_k, other=0.0)
        g = tl.load(proj_ptr + row * RANK + rk, mask=in_r, other=0.0)
        pred = tl.load(pred_ptr + prev * RANK + rk, mask=in_r, other=0.0).to(tl.float32) * g
        succ = tl.load(succ_ptr + cand[:, None] * RANK + rk[None, :], mask=in_k[:, None] & in_r[None, :],
                       other=0.0).to(tl.float32)
        sigma = unary + tl.sum(succ * pred[None, :], axis=1)
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


def select_triton(draft_logits: Tensor, hidden: Tensor, projection: Tensor, predecessor_codebook: Tensor,
                  successor_codebook: Tensor, anchor_tokens: Tensor, k: int, top_k: int, temperature: Tensor,
                  greedy: Tensor, seeds: Tensor, anchor_positions: Tensor, block_v: int | None = None) -> SelectorBatch:
    """``select_torch`` by the Triton kernels (same arguments and result)."""
    _check(draft_logits, hidden, k, top_k)
    batch, _, vocab = draft_logits.shape
    device = draft_logits.device
    rank = projection.shape[0]
    ksel_pad = max(2, triton.next_power_of_2(top_k))
    block_v = block_v or max(min(1024, triton.next_power_of_2(vocab)), ksel_pad)
    num_blocks = triton.cdiv(vocab, block_v)
    logits = draft_logits if draft_logits.stride(-1) == 1 else draft_logits.contiguous()
    rows = batch * k
    part_val = torch.empty((rows, num_blocks, ksel_pad), dtype=torch.float32, device=device)
    part_id = torch.empty((rows, num_blocks, ksel_pad), dtype=torch.int32, device=device)
    cand_ids = torch.empty((batch, k, top_k), dtype=torch.int64, device=device)
    unary = torch.empty((batch, k, top_k), dtype=torch.float32, device=device)
    tokens = torch.empty((batch, k), dtype=torch.int64, device=device)
    probs = torch.empty((batch, k, top_k), dtype=torch.float32, device=device)
    sigma = torch.empty((batch, k, top_k), dtype=torch.float32, device=device)
    if batch == 0:
        return SelectorBatch(tokens, cand_ids, probs, sigma)
    _block_topk_kernel[(rows, num_blocks)](logits, logits.stride(0), logits.stride(1), part_val, part_id, K=k,
                                           KSEL=top_k, KSEL_PAD=ksel_pad, VOCAB=vocab, BLOCK_V=block_v,
                                           NUM_BLOCKS=num_blocks)
    entries = num_blocks * ksel_pad
    if num_blocks > MERGE_BLOCKS:  # two levels: groups of MERGE_BLOCKS blocks in parallel, then their winners
        group = MERGE_BLOCKS * ksel_pad
        groups = triton.cdiv(entries, group)
        group_val = torch.empty((rows, groups, top_k), dtype=torch.float32, device=device)
        group_id = torch.empty((rows, groups, top_k), dtype=torch.int64, device=device)
        _merge_topk_kernel[(rows, groups)](part_val, part_id, group_id, group_val, KSEL=top_k, KSEL_PAD=ksel_pad,
                                           VOCAB=vocab, ENTRIES=entries, GROUP=group,
                                           GROUP_PAD=triton.next_power_of_2(group))
        part_val, part_id, entries = group_val, group_id, groups * top_k
    _merge_topk_kernel[(rows, 1)](part_val, part_id, cand_ids, unary, KSEL=top_k, KSEL_PAD=ksel_pad, VOCAB=vocab,
                                  ENTRIES=entries, GROUP=entries, GROUP_PAD=triton.next_power_of_2(entries))
    projected = (hidden[:, 1:k + 1].float() @ projection.float().T).contiguous()  # [B, k, r]
    _walk_kernel[(batch,)](cand_ids, unary, projected, predecessor_codebook.contiguous(),
                           successor_codebook.contiguous(), anchor_tokens.to(torch.int64).contiguous(),
                           temperature.float().contiguous(), greedy.to(torch.int8).contiguous(), seeds.contiguous(),
                           anchor_positions.to(torch.int64).contiguous(), tokens, probs, sigma, K=k,
                           K_PAD=max(2, triton.next_power_of_2(k)), KSEL=top_k,
                           KSEL_PAD=ksel_pad, RANK=rank, RANK_PAD=max(2, triton.next_power_of_2(rank)))
    return SelectorBatch(tokens, cand_ids, probs, sigma)


def select(*args, all_greedy: bool = False, **kwargs) -> SelectorBatch:
    """The engine's entry point (``select_torch``'s arguments): Triton on CUDA, torch elsewhere.
    ``all_greedy`` (host knowledge) only shortens the torch walk; the Triton walk needs no hint."""
    logits = args[0] if args else kwargs["draft_logits"]
    if use_triton(logits):
        return select_triton(*args, **kwargs)
    return select_torch(*args, all_greedy=all_greedy, **kwargs)
