"""The DFlash 2 draft's conv finish, its residual add and the next RMSNorm as one kernel: twin of
``reference/model/conv.grouped_dynamic_conv`` (side 1) followed by ``reference/model/draft.qwen3_rms_norm``.

B blocks of S rows, C channels in groups of G, K taps; row i of block b, channel c, with the
sublayer output o, the residual stream r (x before the sublayer) and the next norm's weight::

    y_i[c] = sum_{tau < K, tau <= i} (base[tau, c] + delta_i[tau, c // G]) * o_{i - tau}[c]
    h_i    = r_i + y_i                                          the new residual stream
    u_i    = h_i / sqrt(mean_c(h_i^2) + eps) * scale[c]         Qwen3's norm: scale is the stored w

o, r ``[B, S, C]`` (any strides with a unit channel stride); base ``[K, C]`` (side 1 of ``[2, K, C]``);
delta ``[B, S, K, C/G]`` (side 1 of prepare's ``[B, S, 2, K, C/G]``, read in place through its
strides); scale fp32 ``[C]``. Returns ``(h [B, S, C] in o's dtype, u [B, S, C] in out_dtype)``.
Taps never cross a block start (o_{i - tau} = 0 for tau > i).

Rounding, that of the two kernels it replaces (``dynamic_conv.grouped_dynamic_conv_triton`` with a
residual, then ``rms_norm.add_rms_norm_triton`` with no update): the K taps sum in fp32 and y rounds
once to the model dtype; ``r + y`` sums in fp32 and rounds again (the torch form's ``residual + conv``);
the norm reads that rounded h as fp32, and ``(h * rstd) * scale`` rounds once to ``out_dtype``.

``conv_finish_norm_torch`` is that composition of the torch forms (``grouped_dynamic_conv_torch``,
then ``rms_norm.add_rms_norm_torch``), bit for bit. ``conv_finish_norm_triton``: one program per block
row holds the whole row (``BLOCK`` = next_power_of_2(C) <= ``MAX_BLOCK`` channels) in registers,
writes h and, from the same registers, u: one launch instead of two after each of a draft layer's
2 sublayers (the attention finish and the next post-attention norm, the MLP finish and the next
layer's input norm or the final norm): 16 launches fewer a step for the 8-layer draft.

Bound: launch latency (a row of 5120 channels is 10 KiB in bf16). Deterministic (a fixed reduction
tree per row), no host sync, a grid fixed by B * S.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dynamic_conv import _check as _check_conv
from .dynamic_conv import conv_taps, grouped_dynamic_conv_torch
from ..common.pdl import launch_options, pdl_enabled
from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton
from ..dense.rms_norm import add_rms_norm_torch

MAX_BLOCK = 8192  # channels one program holds (C = 5120 pads to 8192), as rms_norm.MAX_BLOCK; no chunked walk here


def _check(o: Tensor, base: Tensor, delta: Tensor, group_size: int, residual: Tensor, scale: Tensor) -> None:
    if residual is None:
        raise ValueError("residual: None: the finish always adds to the residual stream [B, S, C]")
    _check_conv(o, base, delta, group_size, residual)
    channels = o.shape[2]
    if scale.shape != (channels,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale: {list(scale.shape)} {scale.dtype}: expected contiguous fp32 [{channels}]")
    for name, t in (("base", base), ("delta", delta), ("residual", residual), ("scale", scale)):
        if t.device != o.device:
            raise ValueError(f"{name}: on {t.device}: expected o's device {o.device}")


def conv_finish_norm_torch(o: Tensor, base: Tensor, delta: Tensor, group_size: int, residual: Tensor, scale: Tensor,
                           eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The two-call composition: ``h = residual + conv(o)`` in o's dtype, then Qwen3's norm of h.
    Returns ``(h [B, S, C], u [B, S, C] in out_dtype)``."""
    _check(o, base, delta, group_size, residual, scale)
    h = grouped_dynamic_conv_torch(o, base, delta, group_size, residual)
    u = add_rms_norm_torch(h.reshape(-1, h.shape[-1]), None, scale, eps, out_dtype)[1]
    return h, u.view(h.shape)


@triton.jit
def _conv_finish_norm_kernel(o_ptr, base_ptr, delta_ptr, res_ptr, scale_ptr, h_ptr, u_ptr, stride_ob, stride_os,
                             stride_base, stride_db, stride_ds, stride_dk, stride_rb, stride_rs, eps,
                             S: tl.constexpr, C: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    b = (row // S).to(tl.int64)
    i = row % S
    cols = tl.arange(0, BLOCK)
    in_c = cols < C
    # the conv side: the function _grouped_dynamic_conv_kernel sums its taps with (so the same contraction)
    acc = conv_taps(o_ptr, base_ptr, delta_ptr, b, i, cols, in_c, stride_ob, stride_os, stride_base, stride_db,
                    stride_ds, stride_dk, G, K, BLOCK)
    y = acc.to(h_ptr.dtype.element_ty)  # y rounds to the model dtype first, as the conv kernel's output
    r = tl.load(res_ptr + b * stride_rb + i * stride_rs + cols, mask=in_c, other=0.0)
    h = (r.to(tl.float32) + y.to(tl.float32)).to(h_ptr.dtype.element_ty)  # padded lanes: 0 + 0
    out = row.to(tl.int64) * C + cols
    tl.store(h_ptr + out, h, mask=in_c)
    # the norm: _add_rms_norm_kernel's single-chunk path on the rounded h (padding adds 0 to the sum)
    hf = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, axis=0) / C + eps)
    scale = tl.load(scale_ptr + cols, mask=in_c, other=0.0)
    tl.store(u_ptr + out, ((hf * rstd) * scale).to(u_ptr.dtype.element_ty), mask=in_c)


def conv_finish_norm_triton(o: Tensor, base: Tensor, delta: Tensor, group_size: int, residual: Tensor, scale: Tensor,
                            eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``conv_finish_norm_torch`` by one kernel: o, residual, base and delta with any strides and a unit
    channel stride (delta's group axis too), C <= ``MAX_BLOCK``. Returns contiguous ``(h, u)``."""
    _check(o, base, delta, group_size, residual, scale)
    for name, t in (("o", o), ("base", base), ("delta", delta), ("residual", residual)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: strides {t.stride()}: expected a unit last stride")
    batch, rows, channels = o.shape
    if channels > MAX_BLOCK:
        raise ValueError(f"C={channels}: one program holds a whole row, at most {MAX_BLOCK} channels")
    h = torch.empty((batch, rows, channels), dtype=o.dtype, device=o.device)
    u = torch.empty((batch, rows, channels), dtype=out_dtype, device=o.device)
    if h.numel() == 0:
        return h, u
    block = triton.next_power_of_2(channels)
    _conv_finish_norm_kernel[(batch * rows,)](
        o, base, delta, residual, scale, h, u, o.stride(0), o.stride(1), base.stride(0), delta.stride(0),
        delta.stride(1), delta.stride(2), residual.stride(0), residual.stride(1), float(eps), S=rows, C=channels,
        G=group_size, K=base.shape[0], BLOCK=block, PDL=pdl_enabled(o.device),
        num_warps=max(1, min(16, block // 512)),  # add_rms_norm_triton's warps for this block: its reduction tree
        **launch_options(o.device))
    return h, u


conv_finish_norm = KernelOp("conv_finish_norm", conv_finish_norm_torch, GpuForm(conv_finish_norm_triton))
