"""The dense SwiGLU MLP (twin of reference/model/mlp.py), with gate and up fused into one matmul.

    y = W_down (silu(W_gate x) * (W_up x))
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .params import Params


def swiglu(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """x: ``[N, C]``; w_gate_up: ``[2I, C]`` (gate rows first); w_down: ``[C, I]``. Returns ``[N, C]``."""
    gate, up = (x @ w_gate_up.T).chunk(2, dim=-1)  # [N, I] each
    return (F.silu(gate) * up) @ w_down.T


class FastMLP:
    """The dense MLP sublayer, reading ``{prefix}mlp.{gate,up,down}_proj.weight``."""

    def __init__(self, params: Params, prefix: str):
        p = f"{prefix}mlp."
        self.w_gate_up = params.fused(f"{p}gate_proj.weight", f"{p}up_proj.weight")  # [2I, C]
        self.w_down = params.get(f"{p}down_proj.weight")  # [C, I]

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[N, C]`` after post_attention_layernorm. Returns ``[N, C]``."""
        return swiglu(x, self.w_gate_up, self.w_down)
