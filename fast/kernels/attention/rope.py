"""Rotary embedding helpers in torch, shared by the attention kernels' torch twins and the models (twin of
reference/model/rope.py).

The first ``rd`` channels of each head rotate as two halves ``(x1, x2)`` by the angle ``p * f_i``,
``f_i = theta^(-2i/rd)``; the rest pass through::

    x1' = x1 cos - x2 sin,    x2' = x2 cos + x1 sin

cos and sin are computed once per step (``fast/model/step.StepMeta``, the draft's ``forward_blocks``)
and shared by every layer; the rotation runs in fp32.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str) -> Tensor:
    """fp32 ``[D/2]`` ``1 / theta^(2i/D)``, computed on the host (the reference's bits), then moved to ``device``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return (1.0 / (theta ** exponents)).to(device)


def inv_freq(rotary_dim: int, theta: float, device: torch.device | str) -> Tensor:
    """fp32 ``[rd/2]`` ``f_i = theta^(-2i/rd)`` on ``device``, made once per (rd, theta, device) and kept.

    A step's cos/sin then cost one multiply and the two functions rather than four more kernels. The models
    ask for theirs at load (``FastTarget``, ``FastDraft``): a first call inside a CUDA-graph capture would
    copy from the host there."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the key a tensor's .device gives
        device = torch.device("cuda", torch.cuda.current_device())
    return _inv_freq(rotary_dim, float(theta), device)


@functools.lru_cache(maxsize=None)
def _inv_freq(rotary_dim: int, theta: float, device: torch.device) -> Tensor:
    return rope_inv_freq(rotary_dim, theta, device)


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of ``p * f_i`` for each row: fp32 ``[N, rd/2]`` each."""
    freq = inv_freq(rotary_dim, theta, positions.device)  # [rd/2]
    angles = positions.to(torch.float32)[:, None] * freq[None, :]  # [N, rd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: ``[N, H, D]`` (any float dtype); cos, sin: ``[N, rd/2]``. Returns fp32 ``[N, H, D]``."""
    x = x.float()
    half = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
