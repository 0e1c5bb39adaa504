"""A GGUF target whose block-quantized matrices stay quantized: canonical names to :class:`QuantParam`.

``reference/formats/gguf_target.load_gguf_target`` gives every canonical tensor dequantized (the reference
computes in fp32). The fast engine keeps a matrix stored as one of the kernels' types (``QUANT_TYPES``:
Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS) as its file bytes, and computes with it through
``fast/kernels/quant`` (``fast/model/linear.py``). Everything else (norms, biases, the conv, F32/F16/BF16
matrices, types the kernels do not decode such as IQ3_S) is read as the reference reads it.

The converter's transforms (``gguf_target.undo_converter``) on a quantized matrix are permutations of whole
rows or whole input columns, since norms, ``A_log`` and the conv are never block-quantized:

- GDN value heads, stored in tiled order, are regrouped (``value_heads_grouped``). On rows (the V rows of
  ``in_proj_qkv``, ``in_proj_z``, ``in_proj_a``/``b``) the bytes of row ``p[j]`` move to row ``j``: exact,
  a row's blocks are independent. On input columns (``out_proj``, ``[C, Hv Dv]``) a block spans several
  heads, so the bytes stay and the input moves instead: with ``W_c[:, j] = W_s[:, p[j]]``,
  ``W_c x = W_s x_s`` where ``x_s[p[j]] = x[j]``, i.e. ``x_s = x[..., argsort(p)]`` (``input_perm``).
- Split gate/up experts (``ffn_gate_exps`` + ``ffn_up_exps``) are one ``[E, 2I, C]`` weight: their bytes
  concatenated per expert on rows, when both have one type (else both are dequantized).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.formats.errors import CheckpointError
from dflash2.reference.formats.gguf_file import GGUFModel
from dflash2.reference.formats.gguf_target import (gguf_target_config, plan_gguf_target, read_canonical,
                                                   value_heads_grouped)
from dflash2.reference.formats.weights import expected_target_shapes

from ..kernels.quant.layout import QUANT_TYPES, QuantWeight


@dataclass(frozen=True)
class QuantParam:
    """A canonical matrix kept quantized: ``weight`` (canonical rows, the file's input-column order) and
    ``input_perm`` (None, or the ``[cols]`` index that puts a canonical input in the file's column order:
    ``y = quant_linear(x[..., input_perm], weight)``)."""

    weight: QuantWeight
    input_perm: Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def to(self, device: torch.device | str) -> QuantParam:
        perm = None if self.input_perm is None else self.input_perm.to(device)
        return QuantParam(self.weight.to(device), perm)


def load_gguf_target_quantized(path: str | Path) -> tuple[TargetConfig, dict[str, Tensor | QuantParam]]:
    """A GGUF target's config and canonical weights: :class:`QuantParam` (host bytes) for the quantized matrices,
    float32 tensors for the rest (as ``load_gguf_target`` reads them). Tied embeddings share one entry."""
    model = GGUFModel(path)
    cfg = gguf_target_config(model)
    expected = expected_target_shapes(cfg)
    weights: dict[str, Tensor | QuantParam] = {}
    for canonical, names in plan_gguf_target(cfg, model).items():
        quant = _quantized(cfg, model, canonical, names, expected[canonical])
        if quant is not None:
            weights[canonical] = quant
            continue
        weights[canonical] = read_canonical(cfg, model, canonical, names, expected[canonical])
    if cfg.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return cfg, weights


def _quantized(cfg: TargetConfig, model: GGUFModel, canonical: str, names: tuple[str, ...],
               shape: tuple[int, ...]) -> QuantParam | None:
    """The canonical matrix as a :class:`QuantParam`, or None where it is read dequantized (a float or
    undecoded type, a vector, split halves of two types)."""
    stored = [model.stored(name) for name in names]
    qtypes = {qtype for _, qtype in stored}
    if len(qtypes) != 1 or next(iter(qtypes)) not in QUANT_TYPES or len(shape) not in (2, 3):
        return None
    (qtype,) = qtypes
    try:
        parts = [QuantWeight.from_bytes(data, qtype, model.shape(name)) for (data, _), name in zip(stored, names)]
        return quant_param(cfg, canonical, parts, shape)
    except ValueError as e:
        raise CheckpointError(f"{model.path}: tensor {' + '.join(repr(n) for n in names)}: {e}") from None


def quant_param(cfg: TargetConfig, canonical: str, parts: list[QuantWeight], shape: tuple[int, ...]) -> QuantParam:
    """The canonical ``shape`` matrix from the file's quantized parts (one, or gate and up halves concatenated on
    rows): the converter's value-head order undone on rows by moving bytes, on ``out_proj``'s input columns by
    ``input_perm`` (module docstring)."""
    data = parts[0].data if len(parts) == 1 else torch.cat([p.data for p in parts], dim=-2)  # gate|up rows
    got = (*data.shape[:-1], parts[0].cols)
    if tuple(got) != tuple(shape):
        raise ValueError(f"canonical {canonical!r} gives shape {list(got)}, expected {list(shape)}")
    input_perm = None
    if canonical.endswith("linear_attn.out_proj.weight"):
        order = value_heads_grouped(cfg, canonical, torch.arange(shape[-1]).unsqueeze(0))[0]  # p: canonical -> file
        if not torch.equal(order, torch.arange(shape[-1])):
            input_perm = torch.argsort(order)
    elif len(shape) == 2:
        order = value_heads_grouped(cfg, canonical, torch.arange(shape[0]).unsqueeze(1))[:, 0]
        if not torch.equal(order, torch.arange(shape[0])):
            data = data[order]
    return QuantParam(QuantWeight(data.contiguous(), parts[0].qtype, shape), input_perm)


def quantized_bytes(weights: dict[str, Tensor | QuantParam]) -> int:
    """Bytes of the quantized matrices (what the device holds for them), for the startup log."""
    seen = {id(w): w.nbytes for w in weights.values() if isinstance(w, QuantParam)}
    return int(np.sum(list(seen.values()))) if seen else 0
