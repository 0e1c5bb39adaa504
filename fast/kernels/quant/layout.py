"""A GGUF weight kept as its file bytes on the device: :class:`QuantWeight`.

Layout: a matrix of logical shape ``[rows, cols]`` (torch order: ``rows`` = output features, ``cols`` = input
features, GGUF's ``ne`` reversed) is a uint8 tensor ``[rows, row_bytes]``,
``row_bytes = cols / block_elems * block_bytes``: each row is the row's blocks back to back, byte for byte as the
file stores them (``GGUFReader``'s ``tensor.data`` for a quantized type). Nothing is repacked: the kernels decode
the blocks where they lie (fp16 fields are read as two bytes, so no alignment is needed, which Q8_0's 34-byte
blocks would break), and a weight goes from the mmapped file to the device in one copy. Stacked experts are
``[E, rows, row_bytes]``, each expert's matrix contiguous, as in a GGUF ``ffn_*_exps`` tensor.

The block layouts themselves (fields, bytes, the dequant formula) are in ``dequant_torch.py``, next to the code
that decodes them. Sizes are gguf-py's ``GGML_QUANT_SIZES``:

    ========  ===========  ===========  ==============
    type      block_elems  block_bytes  bits / weight
    ========  ===========  ===========  ==============
    Q8_0      32           34           8.5
    Q4_K      256          144          4.5
    Q5_K      256          176          5.5
    Q6_K      256          210          6.5625
    IQ4_XS    256          136          4.25
    IQ3_XXS   256          98           3.0625
    F16/BF16  1            2            16
    F32       1            4            32
    ========  ===========  ===========  ==============
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from torch import Tensor

Q = GGMLQuantizationType

# the block-quantized types the kernels decode (issue 35's list)
QUANT_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_XXS)
# plain float types: their bytes are the values (a view, no decoding)
FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
SUPPORTED_TYPES = QUANT_TYPES + tuple(FLOAT_TYPES)


def block_shape(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """``(block_elems, block_bytes)`` of ``qtype``."""
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"GGML type {Q(qtype).name}: expected one of {', '.join(t.name for t in SUPPORTED_TYPES)}")
    return GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    """Bytes of one row of ``cols`` values; ``cols`` must be whole blocks."""
    elems, nbytes = block_shape(qtype)
    if cols % elems:
        raise ValueError(f"{Q(qtype).name} row of {cols} values: expected a multiple of its {elems}-value block")
    return cols // elems * nbytes


@dataclass(frozen=True)
class QuantWeight:
    """A GGUF matrix on a device: ``data`` uint8 ``[*lead, rows, row_bytes]`` (the file's bytes), ``qtype``, and
    ``shape`` = ``(*lead, rows, cols)`` its logical shape in torch order (``lead``: ``(E,)`` for stacked experts,
    or empty)."""

    data: Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]

    def __post_init__(self):
        qtype = Q(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if len(self.shape) not in (2, 3):
            raise ValueError(f"QuantWeight shape {self.shape}: expected [rows, cols] or [E, rows, cols]")
        want = (*self.shape[:-1], row_bytes(qtype, self.shape[-1]))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            raise ValueError(f"QuantWeight data {self.data.dtype} {list(self.data.shape)}: expected contiguous "
                             f"uint8 {list(want)} for {qtype.name} {list(self.shape)}")

    @classmethod
    def from_bytes(cls, raw: np.ndarray | Tensor, qtype: GGMLQuantizationType, shape: Sequence[int],
                   device: torch.device | str | None = None) -> QuantWeight:
        """From a tensor's raw bytes in any dtype or shape (a ``GGUFReader`` tensor's ``data``: uint8 rows for a
        quantized type, float16/float32 values for F16/F32), reinterpreted, not converted. A read-only numpy
        array (a memory map) is copied once; ``device``: where the bytes go (default: where they are)."""
        if isinstance(raw, np.ndarray):
            raw = np.ascontiguousarray(raw)
            raw = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
        flat = raw.contiguous().reshape(-1).view(torch.uint8)
        shape = tuple(int(n) for n in shape)
        want = math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])
        if flat.numel() != want:
            raise ValueError(f"{Q(qtype).name} {list(shape)}: {flat.numel()} bytes, expected {want}")
        data = flat.reshape(*shape[:-1], -1)
        return cls(data if device is None else data.to(device), qtype, shape)

    @classmethod
    def stack(cls, experts: Sequence[QuantWeight]) -> QuantWeight:
        """Per-expert ``[rows, cols]`` weights of one type as the stacked ``[E, rows, cols]`` form."""
        first = experts[0]
        if any(w.qtype != first.qtype or w.shape != first.shape for w in experts):
            raise ValueError("QuantWeight.stack: expected experts of one type and shape")
        return cls(torch.stack([w.data for w in experts]), first.qtype, (len(experts), *first.shape))

    @property
    def rows(self) -> int:
        return self.shape[-2]

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def num_experts(self) -> int | None:
        """E of the stacked form, None for a single matrix."""
        return self.shape[0] if len(self.shape) == 3 else None

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __getitem__(self, expert: int) -> QuantWeight:
        """Expert ``expert`` of the stacked form (a view of its bytes)."""
        if self.num_experts is None:
            raise TypeError("QuantWeight[...]: only the stacked [E, rows, cols] form has experts")
        return QuantWeight(self.data[expert], self.qtype, self.shape[1:])

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.data.to(device), self.qtype, self.shape)
