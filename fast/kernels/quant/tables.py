"""The lookup tables of the IQ types, taken from gguf-py (``gguf.quants``) rather than copied, so the decoders here
and the reference's numpy dequantization read the same numbers:

- ``IQ3_XXS.grid``: 256 codewords of 4 magnitudes each (values among 4, 12, ..., 62), float32 ``[256, 4]``
  (gguf-py builds it from its packed hex on ``init_grid``; llama.cpp's ``iq3xxs_grid``);
- ``IQ2_XXS.ksigns``: 128 sign bytes, ``ksigns[i] = i | parity(i) << 7`` (7 stored sign bits, the 8th makes
  an even count of minus signs), shared by IQ2_XXS and IQ3_XXS;
- ``IQ4_NL.kvalues``: the 16 non-linear 4-bit levels (-127 .. 113), shared by IQ4_NL and IQ4_XS.

On a device each is a flat tensor: made once per device. The torch twin gathers from all three as gguf-py does.
The Triton decoders read the grid packed (``iq3xxs_grid_packed``: codeword g's four magnitudes as the four bytes of
one int32, so a lookup touches a 1 KiB table, 8 cache lines, rather than 4 KiB) and compute the sign byte as
``i | parity(i) << 7`` (no lookup at all; conformance/ops/test_quant_dequant.py holds that formula to gguf-py's
table, entry by entry).

The fused matmul (``quant_matmul.py``) also reads ``iq3xxs_sign_words``: for each 7-bit sign index i, the sign byte
``ksigns[i]`` spread over two words per half (values 0-3 and 4-7 of its group of 8), ``[N_lo, A_lo, N_hi, A_hi]``
int32: ``N`` has byte k = 0x7F where value k is negative, ``A`` = (byte k = 1 where negative) + 0x40404040. For a
grid word G of four magnitudes m_k (4..62), the low 7 bits of byte k of ``(G ^ N) + A`` are 64 + s_k m_k
(s_k = +-1: a negative byte is 127 - m + 1 + 64 = 192 - m, 64 - m modulo 128; no carry leaves a byte): the signed
values in offset binary, four at a time, from one 16-byte lookup per 8 values.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
from gguf import quants
from torch import Tensor


class IQTables(NamedTuple):
    iq3xxs_grid: Tensor  # float32 [256 * 4]: codeword g's 4 values at 4 g .. 4 g + 3
    ksigns: Tensor  # uint8 [128]
    iq4_kvalues: Tensor  # float32 [16] (the int8 levels, exact in fp32)
    iq3xxs_grid_packed: Tensor  # int32 [256]: byte i of entry g is grid[g][i]
    iq3xxs_sign_words: Tensor  # int32 [128 * 4]: N_lo, A_lo, N_hi, A_hi of sign index i (module docstring)


def _iq3xxs_grid() -> np.ndarray:
    quants.IQ3_XXS.init_grid()  # idempotent: gguf-py's dequantize calls it too
    return np.asarray(quants.IQ3_XXS.grid, dtype=np.float32).reshape(256, 4)


@functools.lru_cache(maxsize=None)
def iq_tables(device: torch.device) -> IQTables:
    """The tables on ``device`` (cached: one copy per device)."""
    grid = torch.from_numpy(_iq3xxs_grid().reshape(-1).copy())
    ksigns = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)
    kvalues = torch.tensor(quants.IQ4_NL.kvalues, dtype=torch.float32)
    packed = torch.from_numpy(_iq3xxs_grid().astype(np.uint8).copy()).view(torch.int32).reshape(256)  # little-endian
    return IQTables(grid.to(device), ksigns.to(device), kvalues.to(device), packed.to(device),
                    _sign_words(ksigns).to(device))


def _sign_words(ksigns: Tensor) -> Tensor:
    """``[N_lo, A_lo, N_hi, A_hi]`` of each sign index (module docstring), int32 ``[128 * 4]``."""
    bits = (ksigns.to(torch.int64)[:, None] >> torch.arange(8)) & 1  # [128, 8]: value k negative
    lsb = (bits.reshape(128, 2, 4) << (8 * torch.arange(4))).sum(-1)  # [128, 2]: byte k = 1 where negative
    words = torch.stack([lsb * 0x7F, lsb + 0x40404040], dim=-1)  # [128, 2 halves, (N, A)]
    return words.reshape(-1).to(torch.int32)
