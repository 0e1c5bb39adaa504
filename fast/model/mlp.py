"""The dense SwiGLU MLP (twin of reference/model/mlp.py), with gate and up fused into one matmul.

    y = W_down (silu(W_gate x) * (W_up x))

The activation ``silu(gate) * up`` of the ``[N, 2I]`` gate|up output is :func:`swiglu_act`: one
kernel on CUDA (fast/kernels/swiglu.py), its torch twin elsewhere; both compute in fp32 and round
once to the model dtype (in bf16 the plain ``F.silu(gate) * up`` rounds twice: the fast engine's
values differ from it by that rounding, within the NUMERIC bounds of docs/tolerances.md; in fp32
they are the same). The MoE's shared expert and the torch form of its experts call :func:`swiglu` too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.swiglu import swiglu_act_triton
from ..kernels.triton_compat import use_triton
from .params import Params


def swiglu_act_torch(gate_up: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """``silu(gate) * up`` in fp32, rounded once  # gate_up [..., 2I] (gate first) -> [..., I] in out_dtype.

    out_dtype defaults to gate_up's dtype; in fp32 this is ``F.silu(gate) * up`` bit for bit.
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype if out_dtype is None else out_dtype)


def swiglu_act(gate_up: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """``swiglu_act_torch``'s contract; one kernel for a 2-D CUDA ``gate_up [N, 2I]``."""
    if use_triton(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return swiglu_act_triton(gate_up, out_dtype)
    return swiglu_act_torch(gate_up, out_dtype)


def swiglu(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """x: ``[N, C]``; w_gate_up: ``[2I, C]`` (gate rows first); w_down: ``[C, I]``. Returns ``[N, C]``."""
    return swiglu_act(x @ w_gate_up.T) @ w_down.T


class FastMLP:
    """The dense MLP sublayer, reading ``{prefix}mlp.{gate,up,down}_proj.weight``."""

    def __init__(self, params: Params, prefix: str):
        p = f"{prefix}mlp."
        self.w_gate_up = params.fused(f"{p}gate_proj.weight", f"{p}up_proj.weight")  # [2I, C]
        self.w_down = params.get(f"{p}down_proj.weight")  # [C, I]

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[N, C]`` after post_attention_layernorm. Returns ``[N, C]``."""
        return swiglu(x, self.w_gate_up, self.w_down)
