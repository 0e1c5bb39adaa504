"""Work that may run beside a step's own stream: forked at one point of the step, joined at a later one.

A verify step's DFlash observe (the context rows, the window and ring writes of every verify row) reads
the target's taps and nothing the rest of the step writes, and nothing after it in the step reads what
it writes: the next step's proposal does. So it need not wait for the last target layers, the LM head,
the verify and the GDN commit. :class:`SideStream` runs it on a second CUDA stream from the moment the
last tap is written (``fork``) and makes the step's stream wait for it at the step's end (``join``)::

    main:  ... layer 37 (last tap) | layers 38-39 | norm | LM head | verify | commit | join
    side:                          \\ observe: fc, norm, context K/V, window and ring writes ---/

Inside a CUDA-graph capture the fork and the join become the graph's edges (the side stream joins the
capture by waiting on the main stream's event); eagerly they are event waits. The two streams never share
a ticket counter: the side stream's kernels draw from ``tickets`` lane 1. The side stream is made with the
higher priority, meant to let its few-program kernels take multiprocessors as they free up rather than queue
behind the LM head's waves (whether a captured graph keeps the priority was not measured). The captured MoE
DFlash step replays faster with the side stream than with the observe in place
(measured: bench/results/2026-12-03-h200-perf10/). Both orders compute the same values: the observe's inputs are written
before the fork, its outputs read after the join. On a CPU device, or with ``enabled`` False
(``EngineConfig.side_stream``: A/B timing and debugging), ``fork`` runs the work at once on the step's own
stream, at the fork's place in the step.

A fork is joined inside the graph it began in: if a capture cuts the step into a new graph before the
join, the cut joins first (``fast/model/capture.join_before_cut``).

Lifetimes: tensors the side work reads must stay referenced until the join (the caller holds the taps
and the batch across it); what the side work allocates is freed on its own stream, which the caching
allocator hands to no other stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.common import tickets
from .capture import join_before_cut

SIDE_LANE = 1  # the tickets lane of the side stream's kernels


class SideStream:
    """One side stream of a device, for :meth:`fork` / :meth:`join` pairs (at most one pending at a time)."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = torch.device(device)
        enabled = enabled and self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device, priority=-1) if enabled else None
        self.pending = False

    def fork(self, work: Callable[[], None]) -> None:
        """Run ``work`` after everything the current stream has queued, beside what it queues next."""
        if self.pending:
            raise RuntimeError("SideStream.fork: the previous fork was not joined")
        if self.stream is None:
            work()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), tickets.lane(SIDE_LANE):
            work()
        self.pending = True
        join_before_cut(self.join)  # a capture must not end a graph with the fork open

    def join(self) -> None:
        """The current stream waits for the forked work (a no-op when none is pending)."""
        if self.pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.pending = False
