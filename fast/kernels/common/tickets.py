"""Zeroed int32 ticket counters, one buffer per device and lane, for kernels whose last program to finish a tile
does the tile's reduction (``skinny_linear``'s split-K).

The pattern, in every kernel that uses it: each program stores its partial, passes a CTA barrier,
takes a ticket from its tile's counter (``tl.atomic_add(..., sem="acq_rel", scope="gpu")``); the one
drawing the last ticket passes another barrier, reads the partials (``cache_modifier=".cg"``: from
L2, not a stale L1), reduces them in a fixed order and resets the counter to 0 with
``tl.atomic_xchg``. So a buffer is all zeros between calls, whoever used it last, and one buffer
serves every such kernel of one stream: they run one after another there (two of them in flight
at once sharing a buffer would share counters and break this). A programmatic dependent launch keeps
them one after another: under ``pdl.py``'s rule a kernel waits, before its first access, for the
previous kernel's full completion (its counter resets included), and the next kernel gets past its
own wait only once this one has completed, so at most one is past its wait.

Lanes: work that runs on a second stream beside the engine's (``fast/model/side_stream.py``: a verify
step's DFlash observe) draws from its own buffer, lane 1, chosen by :func:`lane` around that work, so
kernels of the two streams never share a counter.

A buffer is made on a lane's first call on a device: the engine's eager warm-up (a captured step runs
its function eagerly before capturing it), so a captured graph reads the same persistent buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

MAX_COUNTERS = 16384
_COUNTERS: dict[tuple[torch.device, int], Tensor] = {}
_lane = 0  # the lane ticket_counters draws from (lane() switches it around a side stream's work)


@contextmanager
def lane(index: int) -> Iterator[None]:
    """Within the block, :func:`ticket_counters` hands out lane ``index``'s buffers (0: the engine's stream)."""
    global _lane
    previous, _lane = _lane, index
    try:
        yield
    finally:
        _lane = previous


def ticket_counters(device: torch.device, needed: int) -> Tensor:
    """The device's zeroed int32 ``[MAX_COUNTERS]`` buffer of the current lane; ``needed`` counters must fit in it."""
    if needed > MAX_COUNTERS:
        raise ValueError(f"{needed} ticket counters needed > MAX_COUNTERS={MAX_COUNTERS}: fewer rows or larger tiles")
    key = (torch.device(device), _lane)
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters
