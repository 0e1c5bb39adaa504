"""The SwiGLU activation of a fused gate|up GEMM output, beside its torch twin :func:`swiglu_act_torch` (and so
the activation inside ``reference/model/mlp.swiglu``).

Per row n of ``gate_up [N, 2I]`` (gate columns first, as ``x @ [W_gate; W_up].T`` writes them)::

    out[n, j] = silu(g) * u = g / (1 + exp(-g)) * u     g = gate_up[n, j], u = gate_up[n, I + j], in fp32

rounded once to ``out_dtype`` (default the input's dtype). The torch form it replaces,
``F.silu(gate) * up`` in the model dtype, rounds twice in bf16 (silu's result, then the product); in
fp32 the two agree to the kernel's ``exp`` and division (a few fp32 ulps; the torch twin is that torch
form, bit for bit, in fp32). One read of the ``[N, 2I]`` GEMM output, one write of ``[N, I]``: one kernel
where the torch form runs two (silu, then the multiply, each reading its strided half).

One program per (row, ``BLOCK`` columns). Bound: memory and, at decode and draft sizes (8 rows of
5632), launch latency. Elementwise: deterministic, no host sync, a grid fixed by the shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

import torch.nn.functional as F

from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

def swiglu_act_torch(gate_up: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """``silu(gate) * up`` in fp32, rounded once  # gate_up [..., 2I] (gate first) -> [..., I] in out_dtype.

    out_dtype defaults to gate_up's dtype; in fp32 this is ``F.silu(gate) * up`` bit for bit.
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype if out_dtype is None else out_dtype)


SMALL_ROWS = 32  # up to this many rows, 256-column programs (8 rows x 5632 columns: 176 programs, not 48)


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, stride_x, stride_out, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    g = tl.load(x_ptr + n * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + n * stride_x + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + n * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_act_triton(gate_up: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """:func:`swiglu_act_torch` by the kernel: gate_up ``[N, 2I]`` (any row stride, unit column stride).

    Returns a contiguous ``[N, I]`` in ``out_dtype`` (default gate_up's dtype).
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or (gate_up.shape[1] > 1 and gate_up.stride(1) != 1):
        raise ValueError(f"gate_up: shape {list(gate_up.shape)} strides {gate_up.stride()}: expected [N, 2I] "
                         "rows with unit column stride")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype if out_dtype is None else out_dtype, device=gate_up.device)
    if rows == 0 or width == 0:
        return out
    block = min(triton.next_power_of_2(width), 256 if rows <= SMALL_ROWS else 1024)
    _swiglu_kernel[(rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=width,
                                                      BLOCK=block, num_warps=max(1, min(4, block // 256)))
    return out


swiglu_act = KernelOp("swiglu", swiglu_act_torch,
                      GpuForm(swiglu_act_triton, fits=lambda gate_up, *_: gate_up.dim() == 2 and gate_up.stride(-1) == 1))


def swiglu(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """The SwiGLU MLP ``W_down (silu(W_gate x) * (W_up x))``: x ``[N, C]``; w_gate_up ``[2I, C]`` (gate rows
    first); w_down ``[C, I]``. Returns ``[N, C]``. The GEMMs are cuBLAS's, the activation :data:`swiglu_act`."""
    return swiglu_act(x @ w_gate_up.T) @ w_down.T
