"""Shared pieces of the op conformance tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# docs/tolerances.md, NUMERIC (rms-relative)
NUMERIC_BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def pick(impl: str, torch_fn, triton_fn):
    """The implementation under test: the torch twin or the Triton launcher."""
    return torch_fn if impl == "torch" else triton_fn


@dataclass
class MoECase:
    """The inputs of a routed-experts call and the reference's output (test_moe.py, test_moe_grouped.py)."""

    x: torch.Tensor  # [N, C]
    expert_ids: torch.Tensor  # [N, k] int64
    weights: torch.Tensor  # [N, k] fp32
    gate_up: torch.Tensor  # [E, 2I, C]
    down: torch.Tensor  # [E, C, I]
    expected: torch.Tensor  # [N, C] float64, from the reference

    def inputs(self, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return (self.x.to(device, dtype), self.expert_ids.to(device), self.weights.to(device),
                self.gate_up.to(device, dtype), self.down.to(device, dtype))
