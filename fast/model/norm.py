"""RMSNorm in the two flavours of a Qwen3.5 hybrid (twin of reference/model/norm.py), computed in fp32.

    zero-centred:  y = x / sqrt(mean(x^2) + eps) * (1 + w)        every norm but the GDN output's
    gated:         y = x / sqrt(mean(x^2) + eps) * w * silu(z)     the GDN output norm, per value head

The models keep ``1 + w`` (or ``w``) precomputed in fp32; the result is cast to ``out_dtype``.

A decoder layer adds each sublayer's output to the residual stream and normalises the sum for the
next sublayer: :func:`add_rms_norm` does both (the add in the model dtype, as ``x = x + y`` rounds
it, then the norm in fp32). :func:`add_rms_norm` and :func:`gated_rms_norm` send CUDA tensors to the
fused kernels (fast/kernels/rms_norm.py) and everything else to the torch forms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.rms_norm import add_rms_norm_triton, gated_rms_norm_triton
from ..kernels.triton_compat import use_triton


def _normalize(x: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm(x: Tensor, scale: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """x: ``[..., C]``; scale: fp32 ``[C]``, already ``1 + w``. Returns ``[..., C]`` in ``out_dtype``."""
    return (_normalize(x, eps) * scale).to(out_dtype)


def add_rms_norm_torch(x: Tensor, update: Tensor | None, scale: Tensor, eps: float,
                       out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The residual add and the next norm: ``h = x + update`` (in x's dtype; ``update`` None: h = x).

    x, update: ``[N, C]``; scale: fp32 ``[C]`` (1 + w). Returns ``(h [N, C], rms_norm(h) [N, C] in out_dtype)``.
    """
    h = x if update is None else x + update
    return h, rms_norm(h, scale, eps, out_dtype)


def add_rms_norm(x: Tensor, update: Tensor | None, scale: Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``add_rms_norm_torch``'s contract; CUDA rows go to the fused kernel (one read, one write of each)."""
    if use_triton(x) and x.dim() == 2 and (update is None or update.dtype == x.dtype):
        return add_rms_norm_triton(x, update, scale, eps, out_dtype)
    return add_rms_norm_torch(x, update, scale, eps, out_dtype)


def gated_rms_norm_torch(x: Tensor, gate: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """x, gate: ``[..., Dv]``; weight: fp32 ``[Dv]`` applied as is. Returns ``[..., Dv]`` in ``out_dtype``."""
    return (_normalize(x, eps) * weight * F.silu(gate.float())).to(out_dtype)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """``gated_rms_norm_torch``'s contract; CUDA ``[N, Hv, Dv]`` rows go to the fused kernel."""
    if use_triton(x, gate) and x.dim() == 3:
        return gated_rms_norm_triton(x, gate, weight, eps, out_dtype)
    return gated_rms_norm_torch(x, gate, weight, eps, out_dtype)


def zero_centred_scale(weight: Tensor) -> Tensor:
    """The fp32 multiplier ``1 + w`` of a zero-centred norm weight."""
    return 1.0 + weight.float()
