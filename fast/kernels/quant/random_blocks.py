"""Random GGUF blocks drawn on the device: quantized weights at a real shape with no file (``--load-format dummy
--dummy-weight-type``), so a quantized target can be timed where its checkpoint cannot be downloaded.

Every byte is uniform except the blocks' fp16 scale fields (``HALF_FIELDS``), which are set to finite halves of
magnitude ``[2^-12, 2^-4)`` and either sign: any other byte pattern is a valid block of every type (indices,
nibbles, sign bits and six-bit scales all decode), and the values stay moderate (at most about 63^2 2^-4 for the
K types), so a forward through them stays finite. A kernel reads these bytes exactly as a file's: the timing is
the real one, the values are noise (as dummy bf16 weights are).
"""

from __future__ import annotations

import torch

from .layout import QUANT_TYPES, Q, QuantWeight, block_shape, row_bytes

# byte offsets of each type's fp16 fields within its block (dequant_torch's docstring lays the blocks out)
HALF_FIELDS = {Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,), Q.IQ3_XXS: (0,)}


def random_blocks(qtype: Q, shape: tuple[int, ...], generator: torch.Generator,
                  device: torch.device | str) -> QuantWeight:
    """A :class:`QuantWeight` of logical ``shape`` (``[rows, cols]`` or ``[E, rows, cols]``) and random blocks of
    ``qtype``, drawn on ``device`` with ``generator`` (a generator of that device)."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"random_blocks: {Q(qtype).name} is not a block type; expected one of "
                         f"{', '.join(t.name for t in QUANT_TYPES)}")
    data = torch.randint(0, 256, (*shape[:-1], row_bytes(qtype, shape[-1])), dtype=torch.uint8, device=device,
                         generator=generator)
    blocks = data.view(-1, block_shape(qtype)[1])
    n = blocks.shape[0]
    for offset in HALF_FIELDS[qtype]:
        magnitude = torch.rand(n, device=device, generator=generator) + 1.0  # [1, 2)
        exponent = torch.randint(-12, -4, (n,), device=device, generator=generator).float()
        sign = torch.randint(0, 2, (n,), device=device, generator=generator).float() * 2 - 1
        half = (magnitude * torch.exp2(exponent) * sign).to(torch.float16)
        blocks[:, offset:offset + 2] = half.view(torch.uint8).view(n, 2)
    return QuantWeight(data, qtype, tuple(shape))
