"""RMSNorm, in the two flavours a Qwen3.5 hybrid uses.

Zero-centred RMSNorm (every norm of the model except the GDN output norm)::

    y = x / sqrt(mean(x^2) + eps) * (1 + w)

The weight is stored centred on zero, so a freshly initialised norm is the identity scale.

Gated RMSNorm (the GDN output norm, applied per value head with the gate z)::

    y = x / sqrt(mean(x^2) + eps) * w * silu(z)

Here ``w`` is applied as stored (centred on one). Both are computed in fp32 whatever the input
dtype; the mean runs over the last axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _normalize(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm: ``normalize(x) * (1 + w)``.

    x: ``[..., C]``; weight: ``[C]`` (stored as the offset from one). Returns fp32 ``[..., C]``.
    """
    return _normalize(x, eps) * (1.0 + weight.float())


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gated RMSNorm of the GDN output: ``normalize(x) * w * silu(z)``.

    x, gate: ``[..., Dv]`` (one row per token and value head); weight: ``[Dv]`` (applied as is).
    Returns fp32 ``[..., Dv]``.
    """
    return _normalize(x, eps) * weight.float() * F.silu(gate.float())
