"""Partial rotary position embedding (NeoX layout) at absolute positions.

Only the first ``rd = rotary_dim`` channels of each head rotate; the remaining ``D - rd`` pass
through unchanged. The rotated block is split into two halves ``(x1, x2)`` of ``rd/2`` channels
each (NeoX, not interleaved pairs); channel ``i < rd/2`` of the first half pairs with channel
``i`` of the second half and both turn by the angle ``p * f_i`` at position ``p``::

    f_i  = theta ** (-2i / rd),                 i = 0 .. rd/2 - 1
    x1'  = x1 * cos(p f) - x2 * sin(p f)
    x2'  = x2 * cos(p f) + x1 * sin(p f)

Qwen3.5 configs describe this as multimodal RoPE (``mrope_section``): the rotary frequencies are
split into temporal, height and width sections, each driven by its own position id. For text
every token has the same id on all three axes, so every section turns by ``p * f_i`` and M-RoPE
reduces exactly to the plain partial RoPE written here.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_inv_freq(rotary_dim: int, theta: float) -> Tensor:
    """The rotation frequencies ``f_i = theta^(-2i/rd)``, fp32 ``[rd/2]``."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return 1.0 / (theta ** exponents)


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles ``p * f_i`` for each position, each fp32 ``[T, rd/2]``."""
    angles = positions.to(torch.float32)[:, None] * rope_inv_freq(rotary_dim, theta)[None, :]  # [T, rd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, positions: Tensor, rotary_dim: int, theta: float) -> Tensor:
    """Rotate the first ``rotary_dim`` channels of every head of ``x`` by its token's position.

    x: ``[T, H, D]``; positions: ``[T]`` absolute (int). Returns fp32 ``[T, H, D]``.
    """
    x = x.float()
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)  # [T, rd/2]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, rd/2], broadcast over heads
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
