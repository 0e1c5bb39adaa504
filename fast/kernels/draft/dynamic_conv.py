"""One side of the DFlash 2 draft's grouped dynamic conv over each block, twin of
``reference/model/conv.grouped_dynamic_conv`` (and of its batched torch form here).

B blocks of S rows, C channels in groups of G, K taps; row i of block b, channel c::

    y_i[c] = sum_{tau < K, tau <= i} (base[tau, c] + delta_i[tau, c // G]) * x_{i - tau}[c]
    out_i  = r_i + y_i                    when a residual r is given (the conv finish's ``x + finish``)

Taps never cross a block start (x_{i - tau} = 0 for tau > i). x, r ``[B, S, C]``; base ``[K, C]``
(one side of ``[2, K, C]``); delta ``[B, S, K, C/G]`` (one side of prepare's ``[B, S, 2, K, C/G]``,
read in place through its strides).

``grouped_dynamic_conv_torch`` is the tap loop (pad, expand the group taps, multiply, add: ~5
kernels per tap) in the inputs' dtype. ``grouped_dynamic_conv_triton``: one program per (row,
``BLOCK_C`` channels) sums the K taps in fp32 and rounds y once to the model dtype; with a residual
it then adds r and rounds again, as ``r + y`` rounds in the torch form. One kernel per side. The
draft runs this for the prepare side only: its finish side, with the residual add and the norm after
it, is ``conv_finish_norm`` (which sums the taps by this module's ``conv_taps`` and is held bit for bit
to this kernel's residual form followed by the norm kernel).

Bound: launch latency (a block row of 5120 channels is 10 KiB in bf16). Deterministic, no host sync,
a grid fixed by the shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common.pdl import launch_options, pdl_enabled
from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

MAX_BLOCK_C = 1024  # channels per program: 5120 channels are 5 programs per row


def _check(x: Tensor, base: Tensor, delta: Tensor, group_size: int, residual: Tensor | None) -> None:
    if x.dim() != 3 or base.dim() != 2 or base.shape[1] != x.shape[2]:
        raise ValueError(f"x {list(x.shape)}, base {list(base.shape)}: expected [B, S, C] and [K, C]")
    batch, rows, channels = x.shape
    if group_size < 1 or channels % group_size:
        raise ValueError(f"group_size={group_size} does not divide C={channels}")
    expected = (batch, rows, base.shape[0], channels // group_size)
    if delta.shape != expected:
        raise ValueError(f"delta {list(delta.shape)}: expected {list(expected)} ([B, S, K, C/G])")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {list(residual.shape)} {residual.dtype}: expected x's {list(x.shape)} {x.dtype}")


def grouped_dynamic_conv_torch(x: Tensor, base: Tensor, delta: Tensor, group_size: int,
                               residual: Tensor | None = None) -> Tensor:
    """The module docstring's ``y`` (or ``r + y``) by a loop over taps, in x's dtype. Returns ``[B, S, C]``."""
    _check(x, base, delta, group_size, residual)
    rows = x.shape[1]
    out = torch.zeros_like(x)
    for tau in range(min(base.shape[0], rows)):
        shifted = F.pad(x[:, :rows - tau], (0, 0, tau, 0))  # x_{i - tau}, zero where i < tau
        kernel = base[tau] + delta[:, :, tau].repeat_interleave(group_size, dim=-1)  # [B, S, C]
        out = out + kernel * shifted
    return out if residual is None else residual + out


@triton.jit
def conv_taps(x_ptr, base_ptr, delta_ptr, b, i, cols, in_c, stride_xb, stride_xs, stride_base, stride_db, stride_ds,
              stride_dk, G: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    """The module docstring's y_i over the ``cols`` channels of block b's row i, fp32 ``[BLOCK]`` (not rounded):
    shared with ``conv_finish_norm``'s kernel, so both sum the taps by the one expression."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for tau in tl.static_range(K):
        live = in_c & (i >= tau)  # the tap reaches a row of this block
        xv = tl.load(x_ptr + b * stride_xb + (i - tau) * stride_xs + cols, mask=live, other=0.0).to(tl.float32)
        w = tl.load(base_ptr + tau * stride_base + cols, mask=live, other=0.0).to(tl.float32)
        dv = tl.load(delta_ptr + b * stride_db + i * stride_ds + tau * stride_dk + cols // G, mask=live,
                     other=0.0).to(tl.float32)
        acc += (w + dv) * xv
    return acc


@triton.jit
def _grouped_dynamic_conv_kernel(x_ptr, base_ptr, delta_ptr, res_ptr, out_ptr, stride_xb, stride_xs, stride_base,
                                 stride_db, stride_ds, stride_dk, stride_rb, stride_rs,
                                 S: tl.constexpr, C: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                                 BLOCK_C: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    b = (row // S).to(tl.int64)
    i = row % S
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = cols < C
    acc = conv_taps(x_ptr, base_ptr, delta_ptr, b, i, cols, in_c, stride_xb, stride_xs, stride_base, stride_db,
                    stride_ds, stride_dk, G, K, BLOCK_C)
    y = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:  # r + y with y rounded first, as the torch form's residual + conv
        r = tl.load(res_ptr + b * stride_rb + i * stride_rs + cols, mask=in_c, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * C + cols, y, mask=in_c)


def grouped_dynamic_conv_triton(x: Tensor, base: Tensor, delta: Tensor, group_size: int,
                                residual: Tensor | None = None) -> Tensor:
    """``grouped_dynamic_conv_torch`` by one kernel: any strides with a unit channel stride (delta's
    group axis too). Returns a contiguous ``[B, S, C]`` in x's dtype."""
    _check(x, base, delta, group_size, residual)
    for name, t in (("x", x), ("base", base), ("delta", delta), ("residual", residual)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: strides {t.stride()}: expected a unit last stride")
    batch, rows, channels = x.shape
    out = torch.empty((batch, rows, channels), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    res = residual if residual is not None else x  # unused when HAS_RES is off
    block_c = min(MAX_BLOCK_C, triton.next_power_of_2(channels))
    _grouped_dynamic_conv_kernel[(batch * rows, triton.cdiv(channels, block_c))](
        x, base, delta, res, out, x.stride(0), x.stride(1), base.stride(0), delta.stride(0), delta.stride(1),
        delta.stride(2), res.stride(0), res.stride(1), S=rows, C=channels, G=group_size, K=base.shape[0],
        BLOCK_C=block_c, HAS_RES=residual is not None, PDL=pdl_enabled(x.device), num_warps=4,
        **launch_options(x.device))
    return out


grouped_dynamic_conv = KernelOp("dynamic_conv", grouped_dynamic_conv_torch, GpuForm(grouped_dynamic_conv_triton))
