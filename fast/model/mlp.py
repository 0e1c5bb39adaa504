"""The dense SwiGLU MLP (twin of reference/model/mlp.py), with gate and up fused into one matmul.

    y = W_down (silu(W_gate x) * (W_up x))

The activation ``silu(gate) * up`` of the ``[N, 2I]`` gate|up output is ``kernels/dense/swiglu.swiglu_act``
(one kernel on CUDA, its torch twin elsewhere; both compute in fp32 and round once to the model dtype: in
bf16 the plain ``F.silu(gate) * up`` rounds twice, and the fast engine's values differ from it by that
rounding, within the NUMERIC bounds of docs/tolerances.md; in fp32 they are the same), or the epilogue of
the gate|up GEMM where the skinny kernel is tuned for it (``linear.swiglu_linear``).
"""

from __future__ import annotations

from torch import Tensor

from ..kernels.dense.skinny_linear import skinny_linear
from ..kernels.dense.swiglu import swiglu_act
from .linear import linear, swiglu_linear
from .params import Params


class FastMLP:
    """The dense MLP sublayer, reading ``{prefix}mlp.{gate,up,down}_proj.weight``."""

    ops = (skinny_linear, swiglu_act)  # the kernel ops it runs (FastTarget.capturable)

    def __init__(self, params: Params, prefix: str):
        p = f"{prefix}mlp."
        self.w_gate_up = params.fused(f"{p}gate_proj.weight", f"{p}up_proj.weight")  # [2I, C]
        self.w_down = params.weight(f"{p}down_proj.weight")  # [C, I]

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[N, C]`` after post_attention_layernorm. Returns ``[N, C]``."""
        return linear(swiglu_linear(x, self.w_gate_up), self.w_down)
