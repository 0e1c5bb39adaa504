"""The DFlash draft's context K/V epilogue after its GEMM: k_norm, RoPE and the ring layout in one kernel.

Twin of the context side of ``reference/model/draft.ReferenceDraft.context_kv`` (``qwen3_rms_norm`` of
each K head, then ``rope.apply_rope`` over the whole head) on the output of ``FastDraft.context_kv``'s
batch-invariant GEMM. For row n at position p_n, layer l and KV head j, from ``kv [N, L, 2, Hkv, D]``
(the GEMM output in the draft dtype, [k heads | v heads] per layer)::

    y        = w_l * x / sqrt(mean(x^2) + eps)              fp32, x = kv[n, l, 0, j], w_l = k_norms[l] as stored
    a_i      = float(p_n) * inv_freq_i,  inv_freq_i = 1 / theta^(2i/D)     fp32, i < D/2
    k[l, n, j] = [y1 cos a - y2 sin a,  y2 cos a + y1 sin a]   fp32 (NeoX halves y1 = y[:D/2], y2 = y[D/2:]),
                                                              rounded once to the draft dtype
    v[l, n, j] = kv[n, l, 1, j]                              a copy

both returned contiguous ``[L, N, Hkv, D]``, the layout ``RingPool.write`` takes.

``inv_freq`` is computed once per (D, theta, device) on the host, as the reference and the CPU torch
form compute it (``arange(0, D, 2) / D``, ``theta ** .``, ``1 / .`` in fp32), and kept on the device
(``fast/kernels/attention/rope.rope_inv_freq``, which ``FastDraft`` calls once at load and passes in): the angles
are then the same fp32 products, bit for bit, on every device and in both forms. (A GPU's pow can round
an inv_freq an ulp apart from the host's; at large p that turns the angle by more than the fp32
tolerance allows, see conformance/ops/test_attention_prologue.py.)

:func:`context_k_norm_rope_torch` is the composition ``FastDraft.context_kv`` ran before this kernel,
op for op (``fast/kernels/dense/rms_norm.rms_norm`` in fp32, ``fast/kernels/attention/rope.apply_rope``, one cast, two
transposed copies), with the host's inv_freq; on the CPU its bits are exactly the old ones.

:func:`context_k_norm_rope_triton`: one kernel for the 26 small launches of that composition in a
bf16 draft (7 of the norm, 9 of the angles and cos/sin, 7 of the rotation, the cast, 2 transposed
copies; the host inv_freq already drops 5 of them from the torch form). Grid (N, L): one program per
row and layer holds that row's Hkv x D K tile (and the partner half of each head, a second cached
load), normalises each head with the layer's weight, rotates it with ``tl.cos`` / ``tl.sin`` of the
fp32 angles (libdevice's full-range ``cosf`` / ``sinf`` on CUDA, not the ``.approx`` instructions;
they may differ from torch's by an ulp, within the NUMERIC class), and writes the K tile and the V
tile at ``[l, n]``.

Batch invariant: a program reads its own row only, and the code it runs depends on (Hkv, D) alone,
not on N (``rows`` is not specialised), so a row's K/V bits do not depend on which rows share the
call (a verify of 8 rows, a restore of R * (W-1)); the torch form reduces each head over its own D
channels, likewise per row (conformance/ops/test_context_kv.py holds both to it).

Bound: launch latency at verify sizes (8 rows x L x 2 x Hkv x D: ~130 KiB at release). Deterministic,
no host sync, a grid fixed by N and L.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from ..attention.rope import apply_rope
from ..common.triton_compat import tl, triton
from ..dense.rms_norm import rms_norm

def _check(kv: Tensor, k_norms: Tensor, positions: Tensor, inv_freq: Tensor) -> None:
    """Refuse bad shapes: kv ``[N, L, 2, Hkv, D]`` (D even, unit last stride), k_norms fp32 ``[L, D]``,
    positions integer ``[N]``, all on one device."""
    if kv.dim() != 5 or kv.shape[2] != 2 or kv.shape[-1] % 2 or (kv.shape[-1] > 1 and kv.stride(-1) != 1):
        raise ValueError(f"kv: shape {list(kv.shape)} strides {kv.stride()}: expected [N, L, 2, Hkv, D] (k heads "
                         "then v heads per layer, D even) with unit last stride")
    if not kv.is_floating_point():
        raise ValueError(f"kv: dtype {kv.dtype}: expected the draft's float dtype")
    rows, layers, _, _, dim = kv.shape
    if k_norms.shape != (layers, dim) or k_norms.dtype != torch.float32:
        raise ValueError(f"k_norms: shape {list(k_norms.shape)} {k_norms.dtype}: expected fp32 [{layers}, {dim}] "
                         "(each layer's k_norm weight as stored, for kv's L and D)")
    if positions.shape != (rows,) or positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"positions: shape {list(positions.shape)} {positions.dtype}: expected integer "
                         f"[{rows}] (one absolute position per kv row)")
    if inv_freq.shape != (dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq: shape {list(inv_freq.shape)} {inv_freq.dtype}: expected fp32 [{dim // 2}] "
                         "(rope_inv_freq(D, theta, device))")
    if k_norms.device != kv.device or positions.device != kv.device or inv_freq.device != kv.device:
        raise ValueError(f"kv on {kv.device}, k_norms on {k_norms.device}, positions on {positions.device}, inv_freq "
                         f"on {inv_freq.device}: expected one device")


def context_k_norm_rope_torch(kv: Tensor, k_norms: Tensor, positions: Tensor, eps: float,
                              inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """kv ``[N, L, 2, Hkv, D]`` (the context GEMM's output in the draft dtype), k_norms fp32 ``[L, D]``,
    positions ``[N]``, inv_freq fp32 ``[D/2]`` (``fast/kernels/attention/rope.rope_inv_freq``). Returns (k, v), each contiguous
    ``[L, N, Hkv, D]`` in kv's dtype."""
    _check(kv, k_norms, positions, inv_freq)
    rows, layers, _, kv_heads, dim = kv.shape
    k = rms_norm(kv[:, :, 0], k_norms[:, None, :], eps, torch.float32)  # [N, L, Hkv, D] fp32
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, D/2]
    k = apply_rope(k.reshape(rows, layers * kv_heads, dim), angles.cos(), angles.sin()).to(kv.dtype)
    k = k.reshape(rows, layers, kv_heads, dim)
    return k.transpose(0, 1).contiguous(), kv[:, :, 1].transpose(0, 1).contiguous()


@triton.jit(do_not_specialize=["rows"])  # one compiled kernel whatever N (1, a multiple of 16, ...)
def _context_k_norm_rope_kernel(kv_ptr, norm_ptr, pos_ptr, inv_freq_ptr, k_ptr, v_ptr, rows, stride_n, stride_l,
                                stride_s, stride_h, stride_p, eps, HKV: tl.constexpr, D: tl.constexpr,
                                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    mask = (h < HKV)[:, None] & in_d[None, :]
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    freq = tl.where(first, d, d - HALF)
    src = kv_ptr + n * stride_n + layer * stride_l + h[:, None] * stride_h  # [BLOCK_H, 1] head starts
    x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_H]
    w = tl.load(norm_ptr + layer * D + d, mask=in_d, other=0.0)
    y = (x * rstd[:, None]) * w[None, :]
    xp = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(norm_ptr + layer * D + partner, mask=in_d, other=0.0)
    yp = (xp * rstd[:, None]) * wp[None, :]
    position = tl.load(pos_ptr + n * stride_p).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + freq, mask=in_d, other=0.0)  # [BLOCK_D], torch's fp32 product
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    out = tl.where(first[None, :], y * cos - yp * sin, y * cos + yp * sin)
    dst = ((layer * rows + n) * HKV + h[:, None]) * D + d[None, :]  # [L, N, Hkv, D]
    tl.store(k_ptr + dst, out.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + dst, tl.load(src + stride_s + d[None, :], mask=mask, other=0.0), mask=mask)


def context_k_norm_rope_triton(kv: Tensor, k_norms: Tensor, positions: Tensor, eps: float,
                               inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """``context_k_norm_rope_torch`` by one kernel: kv ``[N, L, 2, Hkv, D]`` (any strides, unit last one),
    k_norms fp32 ``[L, D]``, positions ``[N]``. Returns (k, v), each contiguous ``[L, N, Hkv, D]`` in kv's dtype."""
    _check(kv, k_norms, positions, inv_freq)
    rows, layers, _, kv_heads, dim = kv.shape
    k = torch.empty((layers, rows, kv_heads, dim), dtype=kv.dtype, device=kv.device)
    v = torch.empty_like(k)
    if rows == 0 or layers == 0 or kv_heads == 0 or dim == 0:
        return k, v
    block_h, block_d = triton.next_power_of_2(kv_heads), triton.next_power_of_2(dim)
    _context_k_norm_rope_kernel[(rows, layers)](
        kv, k_norms.contiguous(), positions, inv_freq.contiguous(), k, v, rows, kv.stride(0), kv.stride(1), kv.stride(2),
        kv.stride(3), positions.stride(0), float(eps), HKV=kv_heads, D=dim, HALF=dim // 2, BLOCK_H=block_h,
        BLOCK_D=block_d, num_warps=max(1, min(4, block_h * block_d // 128)))
    return k, v


context_k_norm_rope = KernelOp("context_k_norm_rope", context_k_norm_rope_torch, GpuForm(context_k_norm_rope_triton))
