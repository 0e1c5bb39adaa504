"""Dummy weights as a quantized GGUF target would hold them (``--load-format dummy --dummy-weight-type Q4_K``).

The matrices llama.cpp's quantizer quantizes become :class:`QuantParam` of random blocks of the asked type
(``fast/kernels/quant/random_blocks.py``), drawn on the device; everything else is the dense dummy weight
(``reference/tiny/dummy.py``). So a quantized target times at a real shape from its config.json alone, every
projection reading the bytes a file of that type would make it read.

Which matrices: those llama.cpp's ``llama_model_quantize`` quantizes in a pure (single-type) file: every 2-D
or 3-D weight whose input width is whole blocks, except the router (``ffn_gate_inp``, kept F32), the shared
expert's gate vector and the GDN conv (``ssm_conv1d``: F32). The embedding is quantized too, as in llama.cpp's
files (the fast target dequantizes it once at load for its row lookup).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from ..kernels.quant.layout import Q, block_shape
from ..kernels.quant.random_blocks import random_blocks
from .gguf_quantized import QuantParam

KEPT_DENSE = ("mlp.gate.weight", "shared_expert_gate.weight", "linear_attn.conv1d.weight")


def quantizable(name: str, shape: tuple[int, ...], qtype: Q) -> bool:
    """Whether llama.cpp would store canonical ``name`` as ``qtype`` (module docstring)."""
    return len(shape) in (2, 3) and shape[-1] % block_shape(qtype)[0] == 0 and not name.endswith(KEPT_DENSE)


class DummyQuantizedWeights(Mapping):
    """name -> a cached :class:`QuantParam` of random ``qtype`` blocks for a quantizable matrix, else the dense
    dummy tensor (``dense[name]``; ``fill`` as the dense mapping's)."""

    quantized = True  # Params.quantized: without reading every entry

    def __init__(self, dense: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]], qtype: Q, seed: int,
                 device: torch.device | str, tied: bool):
        self.dense, self.shapes, self.qtype = dense, dict(shapes), Q[qtype] if isinstance(qtype, str) else qtype
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 104_729)
        self.tied = tied
        self._drawn: dict[str, QuantParam] = {}

    def __getitem__(self, name: str) -> Tensor | QuantParam:
        if self.tied and name == "lm_head.weight":
            name = "embed_tokens.weight"
        shape = self.shapes[name]
        if not quantizable(name, shape, self.qtype):
            return self.dense[name]
        if name not in self._drawn:
            self._drawn[name] = QuantParam(random_blocks(self.qtype, shape, self.generator, self.device))
        return self._drawn[name]

    def fill(self, name: str, out: Tensor) -> None:
        if quantizable(name, self.shapes[name], self.qtype):
            raise TypeError(f"{name} is quantized ({self.qtype.name}): read it with Params.weight, not into a buffer")
        self.dense.fill(name, out)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
