"""The entry points the engine calls with a GGUF weight: :func:`dequantize` and :func:`quant_linear`.

``dequantize(qw, dtype)`` -> ``qw.shape`` in ``dtype``: the Triton kernel on CUDA (``dequant_triton``), its torch
twin elsewhere (one :class:`KernelOp`). Stacked experts ``[E, rows, cols]`` dequantize whole, or one expert at a
time through ``qw[e]``.

``quant_linear(x, qw)`` -> ``x @ W^T`` for x ``[..., K]`` and W ``[R, K]``, in x's dtype. It picks by the number of
rows N of x (leading dimensions flattened)::

    N <= FUSED_MAX_ROWS:    quant_matmul (the fused kernel on CUDA: W's bytes streamed once, nothing written)
    N <= CHUNKED_MAX_ROWS:  quant_matmul on consecutive FUSED_MAX_ROWS-row slices of x (W streamed once a slice)
    otherwise:              dequantize(W, x.dtype), then torch's dense matmul (cuBLAS on CUDA)

Past a few dozen rows the product is compute bound and a tensor-core GEMM on the dequantized copy wins, the
copy's write and read being paid once for the whole chunk; at decode and verify rows the fused kernel reads
3-8.5 bits a weight instead of 16 written and 16 read. Where the two cross depends on the GPU, the type and
the shape: FUSED_MAX_ROWS is a tunable, its default the fused kernel's whole domain (``quant_matmul.MAX_ROWS``),
NOT a measured crossover; bench/kernels/bench_quant_linear.py measures both paths (the fused kernel and
dequantize + matmul) at the released shapes, which is what should set it.

The middle path is for verify steps of many requests (16 requests x 8 rows = 128) and the DFlash draft's
logits over the target's head: by bytes it is never worse than the dequantized copy up to 8 slices (8 passes of
4.5-bit Q4_K blocks read 4.5 bytes a weight; the copy writes 2 and reads 2.5), and it allocates no
dequantized copy of W, which for an LM head is gigabytes (248,320 x 5,120 in bf16: 2.4 GiB) in every step's
memory and every captured graph's pool. CHUNKED_MAX_ROWS is that bytes argument, not a timing.

F32/F16/BF16 weights take the last path always (their "dequantize" is a view and a cast).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from .dequant_torch import dequantize_torch
from .dequant_triton import OUT_DTYPES, dequantize_triton
from .layout import QUANT_TYPES, QuantWeight
from .quant_matmul import MAX_ROWS, quant_matmul

FUSED_MAX_ROWS = MAX_ROWS  # tunable (module docstring): the most rows quant_linear sends to the fused kernel
CHUNKED_MAX_ROWS = 8 * FUSED_MAX_ROWS  # the most rows it sends to the fused kernel in slices (module docstring)


def _dequantize_torch(data: Tensor, qw: QuantWeight, dtype: torch.dtype) -> Tensor:
    return dequantize_torch(qw, dtype)


def _dequantize_triton(data: Tensor, qw: QuantWeight, dtype: torch.dtype) -> Tensor:
    return dequantize_triton(qw, dtype)


def _dequantize_fits(data: Tensor, qw: QuantWeight, dtype: torch.dtype) -> bool:
    return qw.qtype in QUANT_TYPES and dtype in OUT_DTYPES


# the op takes the bytes tensor first: KernelOp dispatches by the device of the call's first tensor argument
dequantize_op = KernelOp("quant_dequantize", _dequantize_torch, GpuForm(_dequantize_triton, fits=_dequantize_fits))


def dequantize(qw: QuantWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """``qw``'s values in ``dtype``, shape ``qw.shape`` (the kernel on CUDA, the torch twin elsewhere)."""
    return dequantize_op(qw.data, qw, dtype)


def quant_linear(x: Tensor, qw: QuantWeight) -> Tensor:
    """``x @ W^T``: x ``[..., K]``, ``qw`` ``[R, K]`` -> ``[..., R]`` in x's dtype (the path by row count: module
    docstring)."""
    if len(qw.shape) != 2 or x.shape[-1] != qw.cols:
        raise ValueError(f"x {list(x.shape)}, weight {list(qw.shape)}: expected [..., K] and [R, K]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, qw.cols)
    if qw.qtype in QUANT_TYPES and x2.shape[0] <= FUSED_MAX_ROWS:
        y = quant_matmul(x2, qw)
    elif qw.qtype in QUANT_TYPES and x2.shape[0] <= CHUNKED_MAX_ROWS:
        y = torch.cat([quant_matmul(x2[i:i + FUSED_MAX_ROWS], qw) for i in range(0, x2.shape[0], FUSED_MAX_ROWS)])
    else:
        y = x2 @ dequantize(qw, x.dtype).T
    return y.reshape(*lead, qw.rows)
