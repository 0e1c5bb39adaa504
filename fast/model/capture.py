"""Cut points of a CUDA-graph capture: places in a step where the capture may end one graph and begin the next.

A graph launch costs host time per kernel node before the GPU runs the first one: on the H200
(driver 580, torch 2.11) ``replay()`` of a 549-kernel MoE decode step took 0.57 ms of host time,
and the step's wall time exceeded its GPU time by about that much (scripts/diag/step_trace.py,
bench/results/2026-12-01-h200-perf2/). A step captured as S graphs replayed back to back pays only
the first graph's launch before the GPU starts: while the GPU runs graph i, the host launches
graph i + 1. The graphs share one memory pool and replay in capture order, so a tensor made in one
and read in the next is what it was in the single graph (``fast/engine/graphs.CapturedStep``).

The model marks where a cut may go (:func:`graph_cut`, e.g. between layers); only a capture that
installs a cutter (:func:`cutting`) acts on it. Eager steps and CPU runs see a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

_cut: Callable[[], None] | None = None


def graph_cut() -> None:
    """A point where a capture in progress may end its graph and begin the next; a no-op otherwise."""
    if _cut is not None:
        _cut()


@contextmanager
def cutting(cut: Callable[[], None]) -> Iterator[None]:
    """Within the block, :func:`graph_cut` calls ``cut``."""
    global _cut
    previous, _cut = _cut, cut
    try:
        yield
    finally:
        _cut = previous
