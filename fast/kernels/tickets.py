"""Zeroed int32 ticket counters, one buffer per device, for kernels whose last program to finish a tile
does the tile's reduction (``skinny_linear``'s split-K).

The pattern, in every kernel that uses it: each program stores its partial, passes a CTA barrier,
takes a ticket from its tile's counter (``tl.atomic_add(..., sem="acq_rel", scope="gpu")``); the one
drawing the last ticket passes another barrier, reads the partials (``cache_modifier=".cg"``: from
L2, not a stale L1), reduces them in a fixed order and resets the counter to 0 with
``tl.atomic_xchg``. So the buffer is all zeros between calls, whoever used it last, and one buffer
serves every such kernel: they run one after another on the engine's stream (two of them in flight
at once on one device, e.g. from two streams, would share counters and break this). A programmatic
dependent launch keeps them one after another: under ``pdl.py``'s rule a kernel waits, before its
first access, for the previous kernel's full completion (its counter resets included), and the next
kernel gets past its own wait only once this one has completed, so at most one is past its wait.

The buffer is made on a device's first call: the engine's eager warm-up, before any CUDA-graph
capture, so a captured graph reads the same persistent buffer.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_COUNTERS = 16384
_COUNTERS: dict[torch.device, Tensor] = {}


def ticket_counters(device: torch.device, needed: int) -> Tensor:
    """The device's zeroed int32 ``[MAX_COUNTERS]`` buffer; ``needed`` counters must fit in it."""
    if needed > MAX_COUNTERS:
        raise ValueError(f"{needed} ticket counters needed > MAX_COUNTERS={MAX_COUNTERS}: fewer rows or larger tiles")
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters
