"""Canonical checkpoint tensors (reference/formats/weights.py names) to device tensors for the fast models.

Every tensor is checked against the canonical shape table before use, so a fast model refuses a
checkpoint exactly where the reference would (a :class:`CheckpointError` naming the tensor).
Projections that read the same input are fused into one matrix by the modules (``cat`` on rows).

A GGUF target's quantized matrices arrive as :class:`QuantParam` (``fast/weights/gguf_quantized.py``): :meth:`Params.weight`
and :meth:`Params.fused` keep them quantized (the modules multiply through ``linear.linear``), :meth:`Params.get`
dequantizes (an embedding's row lookup, a weight a kernel needs dense).

Tensor parallelism (``tp`` of size > 1, fast/parallel/): the checkpoint holds the full tensors; :meth:`Params.raw`
checks each against its **full** canonical shape (a bad checkpoint is refused as at tp=1), then serves the rank's
part of it (``fast/parallel/plan.py``: the head, intermediate or vocabulary rows or columns of this rank), and
``cfg`` and :meth:`Params.shape` are the rank's (``plan.rank_config``). Everything above ``raw`` is unchanged,
so the modules build the rank's fused matrices as the concatenation of its parts. GGUF-quantized tensors are
refused under tp for now: cutting a quantized matrix's input columns needs the cut to fall on its blocks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.formats.errors import CheckpointError
from dflash2.reference.formats.weights import expected_target_shapes

from ..kernels.quant.layout import QuantWeight
from ..kernels.quant.quant_linear import dequantize
from ..parallel.group import TPGroup
from ..parallel.plan import rank_config, shard_spec, shard_tensor
from ..weights.gguf_quantized import QuantParam


class Params:
    """Shape-checked access to canonical tensors, converted to the model's dtype and device."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], dtype: torch.dtype,
                 device: torch.device | str, tp: TPGroup | None = None):
        self.tp = tp or TPGroup.single()
        self.full_cfg = cfg
        self.cfg = rank_config(cfg, self.tp.size)  # the rank's view (cfg itself at tp=1)
        self.weights = weights
        # whether any tensor is kept quantized (a GGUF target's), asked by every layer: found once; dummy quantized
        # weights (fast/weights/dummy_quantized.py) say so, a lazy mapping is not read through
        self.quantized = bool(getattr(weights, "quantized", False)) or (
            isinstance(weights, dict) and any(isinstance(w, QuantParam) for w in weights.values()))
        self.dtype = dtype
        self.device = torch.device(device)
        self.shapes = expected_target_shapes(cfg)  # the checkpoint's (full) shapes, checked by raw
        self.local_shapes = expected_target_shapes(self.cfg) if self.tp.parallel else self.shapes
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
        if not self.tp.parallel:
            return tensor
        if isinstance(tensor, QuantParam):
            raise CheckpointError(f"tensor {name!r} is GGUF-quantized: tensor parallelism (tp={self.tp.size}) "
                                  "needs dense weights for now")
        return shard_tensor(tensor, shard_spec(name, self.full_cfg), self.tp.rank, self.tp.size)

    def shape(self, name: str) -> tuple[int, ...]:
        """The canonical shape of ``name`` (read without touching the tensor); the rank's part of it under tp."""
        return tuple(self.local_shapes[name])

    def into(self, name: str, out: Tensor) -> None:
        """Write ``name``'s values into ``out`` (a model's own final buffer, e.g. a slice of a fused tensor), with
        no device copy of the whole tensor beside it: lazy dummy weights draw straight into it (``fill``), a
        loaded checkpoint's host tensor is copied in."""
        fill = getattr(self.weights, "fill", None)
        if fill is None or self.tp.parallel:  # a lazy mapping's fill draws whole tensors: read the part through raw
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
            raw = self.raw(name)
            if isinstance(raw, QuantParam):  # dequantized on the device; the file's column order undone
                dense = dequantize(raw.weight.to(self.device), dtype)
                if raw.input_perm is not None:
                    dense = dense[..., torch.argsort(raw.input_perm.to(self.device))]
                self._converted[key] = dense.contiguous()
            else:
                self._converted[key] = raw.detach().to(device=self.device, dtype=dtype).contiguous()
        return self._converted[key]


    def is_quantized(self, name: str) -> bool:
        """Whether ``name`` is kept as GGUF blocks. Read only where some tensor is (``self.quantized``): drawing a
        dense dummy 35B-A3B layer's experts just to learn their type left 1 GiB blocks in the allocator, layer after
        layer, until the load ran out of memory on an H100."""
        return self.quantized and isinstance(self.raw(name), QuantParam)

    def weight(self, name: str) -> Tensor | QuantParam:
        """A projection weight for ``linear.linear``: kept quantized on the device if the checkpoint stores it so
        (tied embeddings: the head shares the embedding's bytes), else :meth:`get`."""
        raw = self.raw(name)
        if not isinstance(raw, QuantParam):
            return self.get(name)
        tied = name == "lm_head.weight" and self.cfg.tie_word_embeddings
        key = ("embed_tokens.weight" if tied else name, torch.uint8)
        if key not in self._converted:
            self._converted[key] = raw.to(self.device)
        return self._converted[key]

    def fused(self, *names: str) -> Tensor | QuantParam | tuple:
        """Row-wise concatenation of projections that read the same input, in the model dtype. Quantized parts
        (a GGUF target): one :class:`QuantParam` where every part has one type and the file's column order,
        else a tuple of the parts (``linear.linear`` concatenates their products)."""
        raws = [self.raw(n) for n in names]
        if not any(isinstance(r, QuantParam) for r in raws):
            return torch.cat([r.detach().to(device=self.device, dtype=self.dtype) for r in raws]).contiguous()
        kinds = {(r.weight.qtype, r.input_perm is None) if isinstance(r, QuantParam) else None for r in raws}
        if len(kinds) == 1 and None not in kinds and next(iter(kinds))[1]:
            first = raws[0].weight
            data = torch.cat([r.weight.data for r in raws]).to(self.device)
            return QuantParam(QuantWeight(data, first.qtype, (sum(r.shape[0] for r in raws), first.cols)))
        return tuple(self.weight(n) for n in names)


def zero_centred_scale(weight: Tensor) -> Tensor:
    """The fp32 multiplier ``1 + w`` of a zero-centred norm weight (every target norm but the GDN output's)."""
    return 1.0 + weight.float()
