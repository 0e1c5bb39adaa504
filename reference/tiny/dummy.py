"""Dummy weights: random tensors for a target or draft described by its ``config.json`` alone.

``--load-format dummy`` (``ft generate``, ``ft bench``, ``LLM(load_format="dummy")``) builds a
model at any real shape without its safetensors, as other engines offer for benchmarking: the
config is parsed and validated exactly as for a real checkpoint, then every canonical tensor is
drawn where it will live (on the GPU, in the model dtype), with the tiny factories' per-role
scales (``weights.init_target_tensor``, ``draft.init_draft_tensor``) so activations stay finite
through a deep stack.

The result is a lazy :class:`~collections.abc.Mapping`: a tensor is drawn when it is read, from a
generator seeded by (seed, tensor name), and nothing keeps it but the reader. A model that fuses
projections (``cat`` of several tensors) therefore never holds the unfused copies and a fused one
at once, and the same (seed, name) always gives the same values. Random weights accept no drafts:
timings only.

Loading a real shape must not need memory beyond the weights: a tensor larger than ``CHUNK_BYTES`` in
fp32 (an MoE layer's stacked experts, an embedding) is drawn ``CHUNK_BYTES`` at a time along its first
axis, each slice from its own generator (seeded by the tensor's and the slice's start), straight into
its buffer in the model dtype (``fill``: a model may hand its own final buffer, e.g. the experts' slice
of a fused ``[E + 1, ...]`` tensor), so the largest temporary is one fp32 slice.
"""

from __future__ import annotations

import zlib
import math
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from ..formats.config import TargetConfig
from ..formats.draft_checkpoint import expected_draft_shapes
from ..formats.draft_config import DraftConfig
from ..formats.weights import expected_target_shapes
from .draft import init_draft_tensor
from .weights import KEEP_FP32_SUFFIXES, init_target_tensor

DUMMY_LOAD_FORMAT = "dummy"
CHUNK_BYTES = 256 << 20  # fp32 bytes of the largest slice drawn at once (module docstring)


class DummyWeights(Mapping):
    """name -> a freshly drawn tensor ``shapes[name]``, in ``dtype`` on ``device`` (fp32 where releases keep fp32)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], init, seed: int, dtype: torch.dtype,
                 device: torch.device | str, aliases: Mapping[str, str] | None = None):
        self.shapes, self.init, self.seed = dict(shapes), init, seed
        self.dtype, self.device = dtype, torch.device(device)
        self.aliases = dict(aliases or {})  # tied tensors draw the values of the tensor they alias

    def __getitem__(self, name: str) -> Tensor:
        shape = self.shapes[name]
        dtype = torch.float32 if name.endswith(KEEP_FP32_SUFFIXES) else self.dtype
        if self._sliced(shape):
            out = torch.empty(shape, dtype=dtype, device=self.device)
            self.fill(name, out)
            return out
        return self.init(self.aliases.get(name, name), shape, self._generator(name, 0)).to(dtype)

    def fill(self, name: str, out: Tensor) -> None:
        """Draw ``name``'s values into ``out`` (its shape, any dtype, on this mapping's device): the values
        ``self[name]`` has, a first-axis slice at a time when the tensor is large."""
        shape = self.shapes[name]
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{name}: out {list(out.shape)}, expected {list(shape)}")
        source = self.aliases.get(name, name)
        if not self._sliced(shape):
            out.copy_(self.init(source, shape, self._generator(name, 0)))
            return
        rows = self._rows_per_slice(shape)
        for start in range(0, shape[0], rows):
            stop = min(start + rows, shape[0])
            out[start:stop].copy_(self.init(source, (stop - start, *shape[1:]), self._generator(name, start)))

    def _generator(self, name: str, start: int) -> torch.Generator:
        source = self.aliases.get(name, name)
        seed = self.seed * 1_000_003 + zlib.crc32(source.encode()) + 7919 * start
        return torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def _sliced(shape: tuple[int, ...]) -> bool:
        return len(shape) >= 2 and 4 * math.prod(shape) > CHUNK_BYTES

    @staticmethod
    def _rows_per_slice(shape: tuple[int, ...]) -> int:
        return max(1, CHUNK_BYTES // (4 * math.prod(shape[1:])))

    def __contains__(self, name: object) -> bool:
        # Mapping's default draws the tensor (``self[name]``): a membership test must not allocate a weight
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def dummy_target_weights(cfg: TargetConfig, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                         device: torch.device | str = "cpu") -> DummyWeights:
    """Every canonical tensor of the target (MTP head included when the config has one)."""
    hidden = cfg.hidden_size
    aliases = {"lm_head.weight": "embed_tokens.weight"} if cfg.tie_word_embeddings else {}
    return DummyWeights(expected_target_shapes(cfg), lambda n, s, g: init_target_tensor(n, s, g, hidden), seed,
                        dtype, device, aliases)


def dummy_draft_weights(cfg: DraftConfig, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> DummyWeights:
    """Every tensor of the DFlash 2 draft (it borrows the target's embedding and head)."""
    return DummyWeights(expected_draft_shapes(cfg), init_draft_tensor, seed, dtype, device)
