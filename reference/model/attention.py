"""Gated full attention (the Qwen3.5 full-attention token mixer), over an explicit KV cache.

For the normalised layer input ``x_t`` (``[C]``) at absolute position ``p_t``, with H query heads,
Hkv key/value heads (H a multiple of Hkv) and head width D::

    [q_h, gate_h] = (W_q x_t)[h]                          per head: D query then D gate channels
    q_h = RoPE_{p_t}(rmsnorm_q(q_h));   k_j = RoPE_{p_t}(rmsnorm_k((W_k x_t)[j]));   v_j = (W_v x_t)[j]
    a_h = sum_{s <= p_t} softmax_s(q_h . k_{j(h), s} / sqrt(D)) v_{j(h), s}      j(h) = h // (H/Hkv)
    y_t = W_o [a_h * sigmoid(gate_h)]_h

The per-head norms are zero-centred RMSNorms over D; RoPE is partial NeoX (reference/model/rope.py).
The cache holds post-RoPE keys and values of every earlier token at positions 0, 1, ..., so the
key at cache row s sits at position s and causality is ``s <= p_t``. Softmax in fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..formats.config import TargetConfig
from .norm import rms_norm
from .rope import apply_rope


@dataclass
class KVCache:
    """Keys (after RoPE) and values of one attention layer, one row per token seen (fp32)."""

    keys: Tensor  # [T_cache, Hkv, D]
    values: Tensor  # [T_cache, Hkv, D]

    @classmethod
    def empty(cls, cfg: TargetConfig) -> KVCache:
        shape = (0, cfg.num_key_value_heads, cfg.head_dim)
        return cls(keys=torch.zeros(shape), values=torch.zeros(shape))

    @property
    def length(self) -> int:
        return self.keys.shape[0]

    def clone(self) -> KVCache:
        return KVCache(keys=self.keys.clone(), values=self.values.clone())

    def truncate(self, length: int) -> None:
        """Forget every row from ``length`` on (rolling back rejected tokens)."""
        self.keys, self.values = self.keys[:length].clone(), self.values[:length].clone()


def causal_attention(q: Tensor, keys: Tensor, values: Tensor, q_positions: Tensor) -> Tensor:
    """GQA softmax attention of new queries over all cached rows, causal by absolute position.

    q: ``[T, H, D]`` at absolute positions ``q_positions [T]``; keys, values: ``[S, Hkv, D]`` where
    row s holds position s. Returns ``[T, H, D]``.
    """
    heads, kv_heads, d = q.shape[1], keys.shape[1], q.shape[2]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [S, H, D]: query head h reads kv head h // (H/Hkv)
    values = values.repeat_interleave(heads // kv_heads, dim=1)  # [S, H, D]
    scores = torch.einsum("thd,shd->hts", q, keys) * d ** -0.5  # [H, T, S]
    key_positions = torch.arange(keys.shape[0])
    visible = key_positions[None, :] <= q_positions[:, None]  # [T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1)  # [H, T, S]
    return torch.einsum("hts,shd->thd", weights, values)  # [T, H, D]


class GatedAttention:
    """One gated full-attention mixer, reading ``{prefix}self_attn.*`` from the canonical weights."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], prefix: str):
        p = f"{prefix}self_attn."
        self.cfg = cfg
        self.w_q = weights[f"{p}q_proj.weight"]  # [H * 2D, C], per head [query D | gate D]
        self.w_k = weights[f"{p}k_proj.weight"]  # [Hkv D, C]
        self.w_v = weights[f"{p}v_proj.weight"]  # [Hkv D, C]
        self.w_o = weights[f"{p}o_proj.weight"]  # [C, H D]
        self.q_norm = weights[f"{p}q_norm.weight"]  # [D]
        self.k_norm = weights[f"{p}k_norm.weight"]  # [D]

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """x: ``[T, C]`` (after input_layernorm) at ``positions [T]`` = cache.length, +1, ...

        Returns ``[T, C]``; the T new keys and values are appended to ``cache``.
        """
        cfg = self.cfg
        if int(positions[0]) != cache.length:  # row s of the cache must hold position s
            raise ValueError(f"positions start at {int(positions[0])}, the cache holds {cache.length} rows")
        steps, h, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        query_gate = (x @ self.w_q.T).reshape(steps, h, 2 * d)  # [T, H, 2D]
        q, gate = query_gate[..., :d], query_gate[..., d:]  # [T, H, D] each
        k = (x @ self.w_k.T).reshape(steps, hkv, d)  # [T, Hkv, D]
        v = (x @ self.w_v.T).reshape(steps, hkv, d)  # [T, Hkv, D]

        q = apply_rope(rms_norm(q, self.q_norm, cfg.rms_norm_eps), positions, cfg.rotary_dim, cfg.rope_theta)
        k = apply_rope(rms_norm(k, self.k_norm, cfg.rms_norm_eps), positions, cfg.rotary_dim, cfg.rope_theta)
        cache.keys = torch.cat([cache.keys, k], dim=0)  # [T_cache + T, Hkv, D]
        cache.values = torch.cat([cache.values, v], dim=0)

        attn = causal_attention(q, cache.keys, cache.values, positions)  # [T, H, D]
        attn = attn * torch.sigmoid(gate)
        return attn.reshape(steps, h * d) @ self.w_o.T  # [T, C]
