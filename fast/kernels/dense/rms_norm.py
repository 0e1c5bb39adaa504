"""RMSNorm in the two flavours of a Qwen3.5 hybrid (twin of ``reference/model/norm.rms_norm`` and
``gated_rms_norm``): the torch forms and the fused kernels, each pair one :class:`KernelOp`.

    zero-centred:  y = x / sqrt(mean(x^2) + eps) * (1 + w)        every norm but the GDN output's
    gated:         y = x / sqrt(mean(x^2) + eps) * w * silu(z)     the GDN output norm, per value head

The callers keep ``1 + w`` (or ``w``) precomputed in fp32; the result is cast to ``out_dtype``.

Residual add + zero-centred RMSNorm, per row of ``x [N, C]`` and the update ``y [N, C]`` (or none)::

    h = x + y                                 in the model dtype (rounded), as ``x = x + mixer(...)``
    out = h / sqrt(mean(h^2) + eps) * scale   in fp32 (``scale`` = 1 + w, fp32 [C]), cast to ``out_dtype``

returns ``(h, out)``: one read of x and y, one write of h (none when y is None) and of out. One
program per row holds the row in registers (C <= ``MAX_BLOCK``) or walks it in ``MAX_BLOCK`` chunks
twice (sum of squares, then the scaled write), re-reading x and y rather than h so that no program
reads what another thread of it wrote.

Gated RMSNorm of the GDN output, per row n and value head h of ``o [N, Hv, Dv]`` with the gate
``z [N, Hv, Dv]`` (any strides with a unit last one, e.g. a slice of the fused projection)::

    out[n, h] = o / sqrt(mean(o^2) + eps) * w * silu(z)       fp32, cast to ``out_dtype``

one program per (row, ``BLOCK_H`` heads) keeps a ``[BLOCK_H, Dv]`` tile.

Bound: memory and, at decode sizes (a few rows of 5120 channels), launch latency: each kernel
moves a few tens of KiB. Deterministic (fixed reduction trees), no host sync, a grid fixed by N.
"""

from __future__ import annotations

import torch
from torch import Tensor

import torch.nn.functional as F

from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

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


def gated_rms_norm_torch(x: Tensor, gate: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """x, gate: ``[..., Dv]``; weight: fp32 ``[Dv]`` applied as is. Returns ``[..., Dv]`` in ``out_dtype``."""
    return (_normalize(x, eps) * weight * F.silu(gate.float())).to(out_dtype)


MAX_BLOCK = 8192  # channels one program holds at once (C = 5120 pads to 8192: 16 fp32 per thread at 16 warps)


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, scale_ptr, res_ptr, out_ptr, stride_x, stride_y, stride_res, stride_out,
                         eps, C: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, HAS_Y: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        mask = cols < C
        h = tl.load(x_ptr + n * stride_x + cols, mask=mask, other=0.0)
        if HAS_Y:
            h = (h.to(tl.float32) + tl.load(y_ptr + n * stride_y + cols, mask=mask, other=0.0).to(tl.float32))
            h = h.to(res_ptr.dtype.element_ty)  # the residual add rounds to the model dtype first
            tl.store(res_ptr + n * stride_res + cols, h, mask=mask)
        h = h.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / C + eps)
        scale = tl.load(scale_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + n * stride_out + cols, ((h * rstd) * scale).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(NUM_CHUNKS):
            c = i * BLOCK + cols
            mask = c < C
            h = tl.load(x_ptr + n * stride_x + c, mask=mask, other=0.0)
            if HAS_Y:
                h = (h.to(tl.float32) + tl.load(y_ptr + n * stride_y + c, mask=mask, other=0.0).to(tl.float32))
                h = h.to(res_ptr.dtype.element_ty)
                tl.store(res_ptr + n * stride_res + c, h, mask=mask)
            h = h.to(tl.float32)
            sum_sq += h * h
        rstd = tl.math.rsqrt(tl.sum(sum_sq, axis=0) / C + eps)
        for i in range(NUM_CHUNKS):
            c = i * BLOCK + cols
            mask = c < C
            h = tl.load(x_ptr + n * stride_x + c, mask=mask, other=0.0)
            if HAS_Y:
                h = (h.to(tl.float32) + tl.load(y_ptr + n * stride_y + c, mask=mask, other=0.0).to(tl.float32))
                h = h.to(res_ptr.dtype.element_ty)
            h = h.to(tl.float32)
            scale = tl.load(scale_ptr + c, mask=mask, other=0.0)
            tl.store(out_ptr + n * stride_out + c, ((h * rstd) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: Tensor, like: Tensor | None = None) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name}: shape {list(t.shape)} strides {t.stride()}: expected [N, C] rows with unit "
                         "channel stride")
    if like is not None and (t.shape != like.shape or t.dtype != like.dtype or t.device != like.device):
        raise ValueError(f"{name}: {list(t.shape)} {t.dtype} on {t.device}: expected {list(like.shape)} "
                         f"{like.dtype} on {like.device}, as x")


def add_rms_norm_triton(x: Tensor, y: Tensor | None, scale: Tensor, eps: float, out_dtype: torch.dtype | None = None,
                        max_block: int = MAX_BLOCK) -> tuple[Tensor, Tensor]:
    """``add_rms_norm_torch`` by the kernel: x, y ``[N, C]`` (same dtype), scale fp32 ``[C]`` (1 + w).

    Returns ``(x + y [N, C] in x's dtype (x itself when y is None), the norm [N, C] in out_dtype
    (default x's dtype))``, both contiguous when written here. Rows wider than ``max_block`` (a
    power of two) are walked in chunks of it.
    """
    _check_rows("x", x)
    if y is not None:
        _check_rows("y", y, like=x)
    rows, channels = x.shape
    if scale.shape != (channels,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale: {list(scale.shape)} {scale.dtype}: expected contiguous fp32 [{channels}]")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    res = torch.empty_like(x, memory_format=torch.contiguous_format) if y is not None else x
    out = torch.empty((rows, channels), dtype=out_dtype, device=x.device)
    if rows == 0:
        return res, out
    if max_block < 1 or max_block & (max_block - 1):
        raise ValueError(f"max_block={max_block}: expected a power of two")
    block = min(triton.next_power_of_2(channels), max_block)
    _add_rms_norm_kernel[(rows,)](
        x, y if y is not None else x, scale, res, out, x.stride(0), (y if y is not None else x).stride(0),
        res.stride(0), out.stride(0), float(eps), C=channels, BLOCK=block, NUM_CHUNKS=triton.cdiv(channels, block),
        HAS_Y=y is not None, num_warps=max(1, min(16, block // 512)))
    return res, out


@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, stride_on, stride_oh, stride_zn, stride_zh, eps,
                           HV: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads < HV)[:, None] & (d < DV)[None, :]
    o = tl.load(o_ptr + n * stride_on + heads[:, None] * stride_oh + d[None, :], mask=mask, other=0.0)
    o = o.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(o * o, axis=1) / DV + eps)  # [BLOCK_H]
    z = tl.load(z_ptr + n * stride_zn + heads[:, None] * stride_zh + d[None, :], mask=mask, other=0.0)
    z = z.to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < DV, other=0.0)
    y = ((o * rstd[:, None]) * w[None, :]) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + n * (HV * DV) + heads[:, None] * DV + d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_triton(x: Tensor, gate: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """``gated_rms_norm_torch`` by the kernel: x, gate ``[N, Hv, Dv]`` (unit last stride, any dtype),
    weight fp32 ``[Dv]``. Returns a contiguous ``[N, Hv, Dv]`` in ``out_dtype``."""
    if x.dim() != 3 or gate.shape != x.shape or x.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(f"x {list(x.shape)} {x.stride()}, gate {list(gate.shape)} {gate.stride()}: expected "
                         "[N, Hv, Dv] twice with unit last stride")
    rows, heads, dim = x.shape
    if weight.shape != (dim,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"weight: {list(weight.shape)} {weight.dtype}: expected contiguous fp32 [{dim}]")
    out = torch.empty((rows, heads, dim), dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    block_h = min(triton.next_power_of_2(heads), max(1, 1024 // block_d))
    _gated_rms_norm_kernel[(rows, triton.cdiv(heads, block_h))](
        x, gate, weight, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), float(eps), HV=heads, DV=dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out


add_rms_norm = KernelOp("add_rms_norm", add_rms_norm_torch, GpuForm(
    add_rms_norm_triton, fits=lambda x, update, *_: x.dim() == 2 and (update is None or update.dtype == x.dtype)))
gated_rms_norm = KernelOp("gated_rms_norm", gated_rms_norm_torch,
                          GpuForm(gated_rms_norm_triton, fits=lambda x, *_: x.dim() == 3))
