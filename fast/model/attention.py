"""Gated full attention over paged K/V, batched over sequences (twin of reference/model/attention.py).

For the normalised input rows ``x [N, C]`` at absolute positions p::

    [q_h, gate_h] = (W_q x)[h];  q = RoPE_p(rmsnorm_q(q));  k = RoPE_p(rmsnorm_k(W_k x));  v = W_v x
    write k, v at the row's K/V slot (padding rows: the trash row)
    a_h = softmax_{t <= p}(q_h . k_{j(h), t} / sqrt(D)) v_{j(h), t}   over the sequence's paged context
    y   = W_o [a_h * sigmoid(gate_h)]_h                                  j(h) = h // (H/Hkv)

W_q, W_k and W_v are fused into one matmul. The attention core is an op
(:attr:`ModelOps.paged_attention`); :func:`paged_attention_torch` is its torch form (a gather of
each sequence's whole context), :func:`paged_attention` its default: decode and verify steps on
CUDA go to the split-KV kernel (fast/kernels/paged_attention.py), which reads the pages in place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from ..kernels.attention_prologue import output_gate
from ..kernels.paged_attention import MAX_QUERY_LEN, paged_attention_triton
from ..kernels.triton_compat import use_triton
from .norm import zero_centred_scale
from .params import Params
from .pools import PagedKV
from .rope import qk_norm_rope
from .step import StepMeta


def paged_attention_torch(q: Tensor, key_cache: Tensor, value_cache: Tensor, meta: StepMeta) -> Tensor:
    """Causal GQA attention of each row over its sequence's paged K/V.

    q: ``[N, H, D]``; key_cache, value_cache: ``[S, Hkv, D]`` flat slots (S may include the trash
    row). Row n attends keys t of its sequence with ``t < context_len`` and ``t <= position``.
    Scores and softmax in fp32. Returns ``[N, H, D]`` in q's dtype. Slots outside the context are
    zeroed before use, so whatever they hold (NaN poison included) cannot leak in.
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


def paged_attention(q: Tensor, key_cache: Tensor, value_cache: Tensor, meta: StepMeta) -> Tensor:
    """``paged_attention_torch``'s contract; steps of at most 16 rows per sequence (decode, verify)
    on CUDA run the Triton split-KV kernel, everything else (prefill chunks, CPU) the torch form."""
    if use_triton(q, key_cache, value_cache) and 1 <= meta.max_query_len <= MAX_QUERY_LEN:
        return paged_attention_triton(q, key_cache, value_cache, meta)
    return paged_attention_torch(q, key_cache, value_cache, meta)


class FastAttention:
    """One gated full-attention mixer, reading ``{prefix}self_attn.*``."""

    def __init__(self, cfg: TargetConfig, params: Params, prefix: str, paged_attention):
        p = f"{prefix}self_attn."
        self.cfg = cfg
        self.dtype = params.dtype
        self.paged_attention = paged_attention
        self.w_qkv = params.fused(f"{p}q_proj.weight", f"{p}k_proj.weight", f"{p}v_proj.weight")  # [2HD + 2HkvD, C]
        self.w_o = params.get(f"{p}o_proj.weight")  # [C, H D]
        self.q_scale = zero_centred_scale(params.get(f"{p}q_norm.weight", torch.float32))  # [D]
        self.k_scale = zero_centred_scale(params.get(f"{p}k_norm.weight", torch.float32))  # [D]

    def forward(self, x: Tensor, meta: StepMeta, kv: PagedKV) -> Tensor:
        """x: ``[N, C]`` after input_layernorm. Writes the rows' K/V into ``kv``; returns ``[N, C]``."""
        cfg = self.cfg
        rows, h, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        qkv = x @ self.w_qkv.T  # [N, H 2D + 2 Hkv D]
        gate = qkv[:, :2 * h * d].view(rows, h, 2 * d)[..., d:]  # [N, H, D]: per head [query D | gate D]
        q = qk_norm_rope(qkv, self.q_scale, self.k_scale, meta.rope_cos, meta.rope_sin, eps, h, hkv, kv.key_storage,
                         kv.value_storage, meta.kv_write_index)  # [N, H, D]; the rows' K/V are written
        attn = self.paged_attention(q, kv.key_storage, kv.value_storage, meta)  # [N, H, D]
        return output_gate(attn, gate) @ self.w_o.T  # [N, C]
