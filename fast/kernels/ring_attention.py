"""The draft's window attention over the per-request K/V ring, twin of ``reference/draft.window_attention``.

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
a fallback); on the CPU it gathers only from the first position >= 0 of the batch's latest anchor. ``ring_attention_triton``: one program per (block, KV head) holds the
S * H/Hkv query rows of that group as one tile, takes the block's own keys first (every row sees
them, so the running max is finite from the start) and then the context window in BLOCK_N chunks
with an online softmax, skipping chunks that lie entirely before position 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_compat import tl, triton, use_triton


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

@triton.jit
def _online_update(acc, m_i, l_i, scores, v, IEEE: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _ring_attention_kernel(q_ptr, bk_ptr, bv_ptr, rk_ptr, rv_ptr, ring_slot_ptr, anchor_ptr, out_ptr,
                           stride_q, stride_kv, stride_ring_slot, stride_ring_row, scale,
                           S: tl.constexpr, GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                           WINDOW: tl.constexpr, CAPACITY: tl.constexpr, M_PAD: tl.constexpr, S_PAD: tl.constexpr,
                           D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    m = tl.arange(0, M_PAD)
    row_i = m // GROUP  # block row of each query row
    head = kv * GROUP + m % GROUP
    in_m = m < S * GROUP
    d = tl.arange(0, D_PAD)
    in_d = d < D
    q_rows = (b * S + row_i).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q + head[:, None] * D + d[None, :],
                mask=in_m[:, None] & in_d[None, :], other=0.0)

    # the block's own rows: |i - j| < W, visible to every row when S <= W
    j = tl.arange(0, S_PAD)
    in_j = j < S
    kv_rows = (b * S + j).to(tl.int64)
    kv_offs = kv_rows[:, None] * stride_kv + kv * D + d[None, :]
    k = tl.load(bk_ptr + kv_offs, mask=in_j[:, None] & in_d[None, :], other=0.0)
    v = tl.load(bv_ptr + kv_offs, mask=in_j[:, None] & in_d[None, :], other=0.0)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
    near = (row_i[:, None] - j[None, :] < WINDOW) & (j[None, :] - row_i[:, None] < WINDOW)
    scores = tl.where(in_j[None, :] & near, scores, -float("inf"))
    m_i = tl.max(scores, axis=1)
    p = tl.exp(scores - m_i[:, None])
    l_i = tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v)

    # the context window: t = 0 .. W-2 is position s - W + 1 + t; row i reads t >= i and positions >= 0
    anchor = tl.load(anchor_ptr + b)
    ring = tl.load(ring_slot_ptr + b).to(tl.int64)
    first = WINDOW - 1 - anchor  # the first t at position 0
    n = tl.arange(0, BLOCK_N)
    for t0 in range(0, WINDOW - 1, BLOCK_N):
        if t0 + BLOCK_N > first:
            t = t0 + n
            pos = anchor - (WINDOW - 1) + t
            readable = (t < WINDOW - 1) & (pos >= 0)
            slot = tl.where(readable, pos % CAPACITY, 0)
            ring_offs = ring * stride_ring_slot + slot[:, None] * stride_ring_row + kv * D + d[None, :]
            ctx_k = tl.load(rk_ptr + ring_offs, mask=readable[:, None] & in_d[None, :], other=0.0)
            ctx_v = tl.load(rv_ptr + ring_offs, mask=readable[:, None] & in_d[None, :], other=0.0)
            if IEEE:
                ctx_scores = tl.dot(q, tl.trans(ctx_k), input_precision="ieee") * scale
            else:
                ctx_scores = tl.dot(q, tl.trans(ctx_k)) * scale
            seen = readable[None, :] & (t[None, :] >= row_i[:, None])
            ctx_scores = tl.where(seen, ctx_scores, -float("inf"))
            acc, m_i, l_i = _online_update(acc, m_i, l_i, ctx_scores, ctx_v, IEEE)

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * (HKV * GROUP * D) + head[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])


def ring_attention_triton(q: Tensor, block_k: Tensor, block_v: Tensor, ring_k: Tensor, ring_v: Tensor,
                          ring_slots: Tensor, anchor_positions: Tensor, window: int, scale: float | None = None,
                          block_n: int = 64) -> Tensor:
    """``ring_attention_torch`` by the Triton kernel (same arguments and result)."""
    batch, block = _check(q, block_k, block_v, ring_k, ring_v, ring_slots, anchor_positions, window)
    _, heads, dim = q.shape
    kv_heads = block_k.shape[1]
    group = heads // kv_heads
    q, block_k, block_v = (t if t.stride(-1) == 1 and t.stride(-2) == dim else t.contiguous()
                           for t in (q, block_k, block_v))
    ring_k, ring_v = ring_k.contiguous(), ring_v.contiguous()
    out = torch.empty((q.shape[0], heads, dim), dtype=q.dtype, device=q.device)
    _ring_attention_kernel[(batch, kv_heads)](
        q, block_k, block_v, ring_k, ring_v, ring_slots.to(torch.int64).contiguous(),
        anchor_positions.to(torch.int64).contiguous(), out, q.stride(0), block_k.stride(0), ring_k.stride(0),
        ring_k.stride(1), dim ** -0.5 if scale is None else scale, S=block, GROUP=group, HKV=kv_heads, D=dim,
        WINDOW=window, CAPACITY=ring_k.shape[1], M_PAD=max(16, triton.next_power_of_2(block * group)),
        S_PAD=max(16, triton.next_power_of_2(block)), D_PAD=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32)
    return out


def ring_attention(q: Tensor, block_k: Tensor, block_v: Tensor, ring_k: Tensor, ring_v: Tensor,
                   ring_slots: Tensor, anchor_positions: Tensor, window: int, scale: float | None = None) -> Tensor:
    """The engine's entry point: Triton on CUDA, torch elsewhere."""
    fn = ring_attention_triton if use_triton(q) else ring_attention_torch
    return fn(q, block_k, block_v, ring_k, ring_v, ring_slots, anchor_positions, window, scale)
