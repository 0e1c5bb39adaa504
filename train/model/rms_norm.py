"""The two RMSNorms of a Qwen3.5 hybrid, as trainable modules (twins of reference/model/norm.py).

Zero-centred (every norm but the GDN output norm; the weight is stored as the offset from one)::

    y = x / sqrt(mean(x^2) + eps) * (1 + w)

Gated (the GDN output norm, per value head, weight applied as stored)::

    y = x / sqrt(mean(x^2) + eps) * w * silu(z)

Both compute in fp32 whatever the input dtype (bf16 under autocast) and return fp32: the
residual stream stays fp32, and the next matmul casts down under autocast anyway.

Beside them, the DFlash 2 draft's Qwen3 norm (:class:`Qwen3RMSNorm`, ``y = x / sqrt(mean(x^2) + eps) * w``,
the weight as stored), which returns the input's dtype (twin of reference/model/draft.py's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _normalize(x: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm over the last axis; ``weight [C]`` is the offset from one."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[..., C]``. Returns fp32 ``[..., C]``."""
        return _normalize(x, self.eps) * (1.0 + self.weight.float())


class Qwen3RMSNorm(nn.Module):
    """Qwen3's plain RMSNorm over the last axis (the DFlash draft's), ``w * x / sqrt(mean(x^2) + eps)``:
    ``weight [C]`` applied as stored, starting at one; computed in fp32, returned in x's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        return (_normalize(x, self.eps) * self.weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: ``normalize(x) * w * silu(z)`` over the last axis; ``weight [Dv]`` as is."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        """x, gate: ``[..., Dv]``. Returns fp32 ``[..., Dv]``."""
        return _normalize(x, self.eps) * self.weight.float() * F.silu(gate.float())
