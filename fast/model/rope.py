"""Partial NeoX rotary embedding at absolute positions (twin of reference/model/rope.py).

The first ``rd`` channels of each head rotate as two halves ``(x1, x2)`` by the angle ``p * f_i``,
``f_i = theta^(-2i/rd)``; the rest pass through::

    x1' = x1 cos - x2 sin,    x2' = x2 cos + x1 sin

cos and sin are computed once per step (:class:`StepMeta`) and shared by every attention layer;
the rotation runs in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of ``p * f_i`` for each row: fp32 ``[N, rd/2]`` each."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)  # [rd/2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, rd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: ``[N, H, D]`` (any float dtype); cos, sin: ``[N, rd/2]``. Returns fp32 ``[N, H, D]``."""
    x = x.float()
    half = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
