"""Batched gated full attention with partial NeoX RoPE (twin of reference/model/attention.py, rope.py).

For the normalised input ``x [N, T, C]`` of N sequences at positions ``o .. o+T-1``::

    [q_h | gate_h] = (W_q x)[h]                    per head D query channels then D gate channels
    q_h = RoPE(rmsnorm_q(q_h)),  k_j = RoPE(rmsnorm_k((W_k x)[j])),  v_j = (W_v x)[j]
    a_h = causal softmax(q_h k_{h // (H/Hkv)}^T / sqrt(D)) v_{h // (H/Hkv)}      (SDPA, is_causal)
    y   = W_o [a_h * sigmoid(gate_h)]_h

RoPE rotates the first ``rd`` channels of each head in NeoX halves by ``p * theta^(-2i/rd)``;
the rest pass through. The angles are computed once per forward (:func:`rope_cos_sin`) and shared
by every attention layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.reference.formats.config import TargetConfig

from .rms_norm import RMSNorm


def rope_cos_sin(steps: int, offset: int, rotary_dim: int, theta: float,
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin of ``p * f_i`` at positions ``offset .. offset+steps-1``, fp32 ``[T, rd/2]`` each."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    positions = torch.arange(offset, offset + steps, dtype=torch.float32, device=device)
    angles = positions[:, None] * inv_freq[None, :]  # [T, rd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``rd = 2 * cos.shape[-1]`` channels of each head.

    x: ``[N, T, H, D]``; cos, sin: ``[T, rd/2]``. Returns ``[N, T, H, D]``.
    """
    half = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    """One gated causal attention mixer; parameter names are the canonical ``self_attn.*`` names."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        c, h, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.utils.skip_init(nn.Linear, c, 2 * h * d, bias=False)
        self.k_proj = nn.utils.skip_init(nn.Linear, c, hkv * d, bias=False)
        self.v_proj = nn.utils.skip_init(nn.Linear, c, hkv * d, bias=False)
        self.o_proj = nn.utils.skip_init(nn.Linear, h * d, c, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: ``[N, T, C]`` (after input_layernorm); cos, sin ``[T, rd/2]`` for its positions. Returns ``[N, T, C]``."""
        cfg = self.cfg
        n, steps, _ = x.shape
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        query_gate = self.q_proj(x).reshape(n, steps, h, 2 * d)
        q, gate = query_gate[..., :d], query_gate[..., d:]  # [N, T, H, D] each
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(n, steps, hkv, d)), cos, sin)  # [N, T, Hkv, D]
        v = self.v_proj(x).reshape(n, steps, hkv, d)
        # query head i reads kv head i // (H/Hkv); expanded here so every SDPA backend applies
        k, v = (t[:, :, :, None].expand(n, steps, hkv, h // hkv, d).reshape(n, steps, h, d) for t in (k, v))
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True)  # [N, H, T, D]
        attn = attn.transpose(1, 2) * torch.sigmoid(gate)  # [N, T, H, D]
        return self.o_proj(attn.reshape(n, steps, h * d))
