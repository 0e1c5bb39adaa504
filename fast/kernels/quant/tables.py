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
    return IQTables(grid.to(device), ksigns.to(device), kvalues.to(device), packed.to(device))
