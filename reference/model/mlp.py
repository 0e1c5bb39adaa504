"""The dense SwiGLU MLP of the Qwen3.5 dense models (also the MoE's shared expert and each expert).

    y = W_down (silu(W_gate x) * (W_up x))
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn.functional as F
from torch import Tensor

from ..formats.config import TargetConfig


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """x: ``[T, C]``; w_gate, w_up: ``[I, C]``; w_down: ``[C, I]``. Returns ``[T, C]``."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


class DenseMLP:
    """The dense MLP sublayer, reading ``{prefix}mlp.{gate,up,down}_proj.weight``."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], prefix: str):
        p = f"{prefix}mlp."
        self.w_gate = weights[f"{p}gate_proj.weight"]  # [I, C]
        self.w_up = weights[f"{p}up_proj.weight"]  # [I, C]
        self.w_down = weights[f"{p}down_proj.weight"]  # [C, I]

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[T, C]`` (after post_attention_layernorm). Returns ``[T, C]``."""
        return swiglu(x, self.w_gate, self.w_up, self.w_down)
