"""Partial NeoX rotary embedding at absolute positions (twin of reference/model/rope.py).

The first ``rd`` channels of each head rotate as two halves ``(x1, x2)`` by the angle ``p * f_i``,
``f_i = theta^(-2i/rd)``; the rest pass through::

    x1' = x1 cos - x2 sin,    x2' = x2 cos + x1 sin

cos and sin are computed once per step (:class:`StepMeta`) and shared by every attention layer;
the rotation runs in fp32.

:func:`qk_norm_rope` is the whole attention prologue after the fused projection: the per-head
RMSNorms of q and k, RoPE, the cast to the model dtype and the K/V cache write; CUDA rows go to one
kernel (fast/kernels/attention_prologue.py), everything else to :func:`qk_norm_rope_torch`.
:func:`draft_qk_norm_rope` is the DFlash draft's: the same norms and rotation of its q and k (full
rotation, weights as stored), returned in the draft dtype.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..kernels.attention_prologue import draft_qk_norm_rope_triton, qk_norm_rope_triton
from ..kernels.triton_compat import use_triton
from .norm import rms_norm


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str) -> Tensor:
    """fp32 ``[D/2]`` ``1 / theta^(2i/D)``, computed on the host (the reference's bits), then moved to ``device``.
    :func:`inv_freq` keeps one per (D, theta, device), so no step uploads it (nor a graph capture)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return (1.0 / (theta ** exponents)).to(device)


def inv_freq(rotary_dim: int, theta: float, device: torch.device | str) -> Tensor:
    """fp32 ``[rd/2]`` ``f_i = theta^(-2i/rd)`` on ``device``: computed once on the host (the reference's bits,
    :func:`rope_inv_freq`) and kept, so a step's cos/sin cost one multiply and the two functions rather
    than four more kernels (arange, divide, pow, reciprocal). The models ask for theirs at load
    (``FastTarget``, ``FastDraft``): a first call inside a CUDA-graph capture would copy from the host there."""
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


def qk_norm_rope_torch(qkv: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor, eps: float,
                       num_heads: int, num_kv_heads: int, key_cache: Tensor, value_cache: Tensor,
                       write_index: Tensor) -> Tensor:
    """The attention prologue: ``q = rope(rmsnorm_q(q))``, and ``rope(rmsnorm_k(k))``, v into the caches.

    qkv: ``[N, H*2D + 2*Hkv*D]`` the fused projection (per query head ``[query D | gate D]``, then K,
    then V); q_scale, k_scale: fp32 ``[D]`` (1 + w); cos, sin: fp32 ``[N, rd/2]``; key_cache,
    value_cache: ``[S, Hkv, D]``, row ``write_index[n]`` receives row n's K and V (in the model
    dtype, then the cache's). Returns q ``[N, H, D]`` in qkv's dtype. Norms and rotation in fp32.
    """
    rows, dim = qkv.shape[0], key_cache.shape[-1]
    query_gate, k, v = torch.split(qkv, [2 * num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
    q = query_gate.view(rows, num_heads, 2 * dim)[..., :dim]  # [N, H, D]
    q = apply_rope(rms_norm(q, q_scale, eps, torch.float32), cos, sin).to(qkv.dtype)
    k = apply_rope(rms_norm(k.view(rows, num_kv_heads, dim), k_scale, eps, torch.float32), cos, sin).to(qkv.dtype)
    key_cache.index_copy_(0, write_index, k.to(key_cache.dtype))
    value_cache.index_copy_(0, write_index, v.view(rows, num_kv_heads, dim).to(value_cache.dtype))
    return q


def qk_norm_rope(qkv: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor, eps: float,
                 num_heads: int, num_kv_heads: int, key_cache: Tensor, value_cache: Tensor,
                 write_index: Tensor) -> Tensor:
    """``qk_norm_rope_torch``'s contract, by one kernel on CUDA."""
    fn = qk_norm_rope_triton if use_triton(qkv, key_cache, value_cache) else qk_norm_rope_torch
    return fn(qkv, q_scale, k_scale, cos, sin, eps, num_heads, num_kv_heads, key_cache, value_cache, write_index)


def draft_qk_norm_rope_torch(q: Tensor, k: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor,
                             eps: float) -> tuple[Tensor, Tensor]:
    """``rope(x / rms(x) * scale)`` per head of q ``[N, H, D]`` and k ``[N, Hkv, D]``, in fp32.

    q_scale, k_scale: fp32 ``[D]`` (the draft's Qwen3 norms: the weights as stored); cos, sin: fp32
    ``[N, rd/2]``. Returns (q, k) in the inputs' dtype.
    """
    q_out = apply_rope(rms_norm(q, q_scale, eps, torch.float32), cos, sin).to(q.dtype)
    return q_out, apply_rope(rms_norm(k, k_scale, eps, torch.float32), cos, sin).to(k.dtype)


def draft_qk_norm_rope(q: Tensor, k: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    """``draft_qk_norm_rope_torch``'s contract, by one kernel on CUDA."""
    fn = draft_qk_norm_rope_triton if use_triton(q, k) else draft_qk_norm_rope_torch
    return fn(q, k, q_scale, k_scale, cos, sin, eps)
