"""RMSNorm in the two flavours of a Qwen3.5 hybrid (twin of reference/model/norm.py), computed in fp32.

    zero-centred:  y = x / sqrt(mean(x^2) + eps) * (1 + w)        every norm but the GDN output's
    gated:         y = x / sqrt(mean(x^2) + eps) * w * silu(z)     the GDN output norm, per value head

The models keep ``1 + w`` (or ``w``) precomputed in fp32; the result is cast to ``out_dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _normalize(x: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm(x: Tensor, scale: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """x: ``[..., C]``; scale: fp32 ``[C]``, already ``1 + w``. Returns ``[..., C]`` in ``out_dtype``."""
    return (_normalize(x, eps) * scale).to(out_dtype)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """x, gate: ``[..., Dv]``; weight: fp32 ``[Dv]`` applied as is. Returns ``[..., Dv]`` in ``out_dtype``."""
    return (_normalize(x, eps) * weight * F.silu(gate.float())).to(out_dtype)


def zero_centred_scale(weight: Tensor) -> Tensor:
    """The fp32 multiplier ``1 + w`` of a zero-centred norm weight."""
    return 1.0 + weight.float()
