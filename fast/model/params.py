"""Canonical checkpoint tensors (reference/formats/weights.py names) to device tensors for the fast models.

Every tensor is checked against the canonical shape table before use, so a fast model refuses a
checkpoint exactly where the reference would (a :class:`CheckpointError` naming the tensor).
Projections that read the same input are fused into one matrix by the modules (``cat`` on rows).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.formats.errors import CheckpointError
from dflash2.reference.formats.weights import expected_target_shapes


class Params:
    """Shape-checked access to canonical tensors, converted to the model's dtype and device."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], dtype: torch.dtype,
                 device: torch.device | str):
        self.cfg = cfg
        self.weights = weights
        self.dtype = dtype
        self.device = torch.device(device)
        self.shapes = expected_target_shapes(cfg)
        # converted tensors by (name, dtype); a tied head shares its embedding's entry, so it is converted once.
        # Keyed by name, not id(tensor): a lazy mapping (dummy weights) draws a new tensor per read, and a
        # freed tensor's id can be reused by the next one.
        self._converted: dict[tuple[str, torch.dtype], Tensor] = {}

    def raw(self, name: str) -> Tensor:
        if name not in self.shapes:
            raise KeyError(f"{name!r} is not a canonical tensor of this target")
        shape = self.shapes[name]
        if name not in self.weights:
            raise CheckpointError(f"tensor {name!r} is missing: expected a tensor of shape {list(shape)}")
        tensor = self.weights[name]
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {list(tensor.shape)}: expected {list(shape)}")
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The canonical shape of ``name`` (read without touching the tensor)."""
        return tuple(self.shapes[name])

    def into(self, name: str, out: Tensor) -> None:
        """Write ``name``'s values into ``out`` (a model's own final buffer, e.g. a slice of a fused tensor), with
        no device copy of the whole tensor beside it: lazy dummy weights draw straight into it (``fill``), a
        loaded checkpoint's host tensor is copied in."""
        fill = getattr(self.weights, "fill", None)
        if fill is None:
            out.copy_(self.raw(name).detach())
            return
        if name not in self.shapes:
            raise KeyError(f"{name!r} is not a canonical tensor of this target")
        fill(name, out)

    def get(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """The tensor in ``dtype`` (default: the model dtype) on the model's device."""
        dtype = dtype or self.dtype
        tied = name == "lm_head.weight" and self.cfg.tie_word_embeddings
        key = ("embed_tokens.weight" if tied else name, dtype)
        if key not in self._converted:
            self._converted[key] = self.raw(name).detach().to(device=self.device, dtype=dtype).contiguous()
        return self._converted[key]

    def fused(self, *names: str) -> Tensor:
        """Row-wise concatenation of projections that read the same input, in the model dtype."""
        return torch.cat([self.raw(n).detach().to(device=self.device, dtype=self.dtype) for n in names]).contiguous()


def zero_centred_scale(weight: Tensor) -> Tensor:
    """The fp32 multiplier ``1 + w`` of a zero-centred norm weight (every target norm but the GDN output's)."""
    return 1.0 + weight.float()
