"""Cut points of a CUDA-graph capture: places in a step where the capture may end one graph and begin the next.

A graph launch costs host time per kernel node before the GPU runs the first one: ``replay()`` of a
whole MoE decode step as one graph spends host time in proportion to its kernels, and the step's wall time
exceeded its GPU time by about that much (scripts/diag/step_trace.py; measured:
bench/results/2026-12-01-h200-perf2/trace-35b-a3b-off-host-profile.txt). A step captured as S graphs
replayed back to back pays only the first graph's launch before the GPU starts: while the GPU runs graph i,
the host launches graph i + 1. The graphs share one memory pool and replay in capture order, so a tensor made in one
and read in the next is what it was in the single graph (``fast/engine/graph_step.CapturedStep``).

The first graphs are kept short (:func:`layer_cuts`): the GPU idles until the first launch
returns, and the longer graphs behind it launch while it runs.

The model marks where a cut may go (:func:`graph_cut`, e.g. between layers); only a capture that
installs a cutter (:func:`cutting`) acts on it. Eager steps and CPU runs see a no-op.

Work forked onto a side stream (``fast/model/side_stream.py``) must be joined inside the graph it
began in: a fork registers its join with :func:`join_before_cut`, and the next cut of a capture runs
it first. Outside a capture the join is the forker's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

LAYER_GROUPS = 4  # long graphs a captured target forward is cut into (a graph's launch grows with its kernels)
EARLY_CUTS = (1, 3)  # and short ones first: layer 0, then layers 1-2

_cut: Callable[[str | None], None] | None = None
_joins: list[Callable[[], None]] = []  # side-stream joins due before the capture's next cut


def layer_cuts(num_layers: int, groups: int = LAYER_GROUPS) -> frozenset[int]:
    """The layers before which a captured forward of ``num_layers`` layers begins a new graph: the
    :data:`EARLY_CUTS`, then every ceil(num_layers / groups) layers."""
    per_graph = -(-num_layers // groups)
    return frozenset(i for i in (*EARLY_CUTS, *range(per_graph, num_layers, per_graph)) if 0 < i < num_layers)


def graph_cut(mark: str | None = None) -> None:
    """A point where a capture in progress may end its graph and begin the next; a no-op otherwise.
    ``mark`` names the point, so a replay can stop there and go on later (``CapturedStep.marks``)."""
    if _cut is not None:
        while _joins:
            _joins.pop()()
        _cut(mark)


def join_before_cut(join: Callable[[], None]) -> None:
    """Inside a capture, have the next :func:`graph_cut` call ``join`` before it ends the graph (a no-op
    outside one, where nothing is cut). ``join`` must be safe to call again (its owner joins at its end too)."""
    if _cut is not None:
        _joins.append(join)


@contextmanager
def cutting(cut: Callable[[str | None], None]) -> Iterator[None]:
    """Within the block, :func:`graph_cut` calls ``cut`` with its mark."""
    global _cut
    previous, _cut = _cut, cut
    outer_joins = _joins[:]
    _joins.clear()
    try:
        yield
    finally:
        _cut = previous
        _joins[:] = outer_joins  # joins no cut came to are their owners' (each joins at the end of its work)
