"""Shared pieces of the op conformance tests."""

from __future__ import annotations

import torch

# docs/tolerances.md, NUMERIC (rms-relative)
NUMERIC_BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def pick(impl: str, torch_fn, triton_fn):
    """The implementation under test: the torch twin or the Triton launcher."""
    return torch_fn if impl == "torch" else triton_fn
