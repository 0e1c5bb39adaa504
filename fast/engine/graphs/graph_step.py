"""The captured steps: decode forwards and whole speculative steps as CUDA graphs, captured per key and replayed.

Launched eagerly, a decode or verify step of a 40-64-layer hybrid is hundreds to thousands of small kernels,
and at a few requests their launch gaps cost more than the weights' bytes. Each step shape (a ``GraphKey``,
``step_buffers.py``) is captured once and replayed:

- :class:`TargetGraphs`: the target forward alone (plain decode: one row per request; also a verify's forward
  when the whole step cannot be captured). One upload carries the batch, the tokens and the sampling
  parameters.
- :class:`StepGraphs`: a whole speculative step, propose -> target verify forward -> verify -> commit ->
  observe (``fast/speculative/step.py``), greedy and sampled alike (the key carries the batch's sampling
  summary, which fixes the filter's launches). Requests that draft fewer than the step's k (near their
  max_tokens) replay the same capture, each verifying only its own k_b (``StepFields.draft_limits``).

A capture is a few CUDA graphs replayed back to back, cut between stages and between layers (two short graphs
first, then layer groups: ``fast/model/capture.py``), so the host's launch of one overlaps the GPU's run of the
one before. Capture happens on first use of a key, on all-padding inputs (the warm-up runs and the capture then
touch only the trash slot and row), so no step runs twice. All graphs of one kind share one memory pool: they
replay one at a time, and each step's outputs are read before the next replay (or, a step that launches the next
proposal ahead, copied out first). A prefill chunk replays a graph of ``prefill_graphs.py`` where it is short
and those are on (``EngineConfig.prefill_graph_rows``). A step that fits no graph (any other prefill chunk, more
requests than max_running_req, a traced step or one asking for logprobs, CPU tensors, or ops that synchronise with
the host) runs eagerly (``runner.py``); ``enforce_eager`` runs every step eagerly.

Eager and replay compute the same padded batch with the same kernels, so their outputs are equal bit for bit
(``conformance/gpu/test_cuda_graphs.py``); an unpadded eager step may differ in rounding, since GEMM kernels
are chosen by row count.

Split speculative steps (a proposer that reads no block table: DFlash): the step's function marks the end of
its proposal (``graph_cut(PROPOSED)``), and a replay uploads the proposal's fields, launches the proposal's
graphs, and only then fills and uploads the rest of the batch and launches the verify's, so the host's fill
runs while the GPU drafts (bench/results/2026-12-01-h200-perf3/). The step's graphs end by advancing the
proposal fields as the host will for the next step (:func:`advance_proposal_fields`), and the run remembers what
the device then holds: a next step asking for exactly those values finds them uploaded, and may find its
proposal already launched (``propose_ahead.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from dflash2.reference.request.sampling_params import SamplingParams

from ...kernels.sampling.sampler import HostSummary, SamplingTensors
from ...model.capture import cutting, graph_cut
from ...model.target import FastOutput, FastTarget
from ...model.batch import PAD_SLOT, ForwardBatch
from ...model.pools import CachePools
from ...speculative.step import SpeculativeStep
from .propose_ahead import Prediction, ProposeAhead
from ..sampling import sample_next
from .step_buffers import (PROPOSAL_FIELDS, GraphKey, StaticInputs, StepFields, batch_view, buckets, field_sizes,
                           fill_batch, fill_sampling, fill_tables, fill_values, page_bucket, real_rows,
                           speculative_rows)

PROPOSED = "proposed"  # the graph_cut mark after a speculative step's proposal


class CapturedStep:
    """``fn(fields)`` captured once over ``inputs`` (all padding when captured); ``replay`` reruns it.

    The capture is cut into several graphs where ``fn`` calls ``fast/model/capture.graph_cut`` (the target and
    the draft at ``capture.layer_cuts``, a speculative step between its stages): replayed back to back, each
    graph's host launch overlaps the GPU's run of the one before. On a CPU device nothing is captured and
    ``replay`` calls ``fn`` on the static fields: the same buffers and padding, so the CPU lane tests
    everything here but the capture itself.
    """

    def __init__(self, inputs: StaticInputs, fn: Callable[[StepFields], object], device: torch.device,
                 mempool, pool_replays: list[int] | None = None) -> None:
        self.inputs, self.fn = inputs, fn
        self.ends = 0  # replays that ran the step's end (stop None), a diagnostic's too; StepGraphs trusts its own
        self.pool_replays = pool_replays  # every replay of the graphs sharing this step's memory pool, counted
        # the pinned copy of the output, and the event that says it has landed, for a step that launches the next
        # proposal before it reads (StepGraphs._read_proposing_ahead makes them on first use)
        self.result: Tensor | None = None
        self.result_ready: torch.cuda.Event | None = None
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.marks: dict[str, int] = {}  # a named graph_cut -> the graphs captured before it
        if device.type != "cuda":
            return
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles Triton kernels, creates cuBLAS handles and workspaces
                fn(inputs.device)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)

        def begin() -> None:
            self.graphs.append(torch.cuda.CUDAGraph())
            self.graphs[-1].capture_begin(pool=mempool)

        def cut(mark: str | None) -> None:
            with warnings.catch_warnings():
                # a cut with nothing captured since the capture began or since the last cut leaves an empty graph:
                # kept, so the marks index the graphs as captured; torch warns of it as if the capture had missed
                # the stream
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                self.graphs[-1].capture_end()
            if mark is not None:
                self.marks[mark] = len(self.graphs)
            begin()

        with torch.cuda.stream(torch.cuda.Stream(device)):
            begin()
            try:
                with cutting(cut):
                    self.out = fn(inputs.device)
            finally:
                self.graphs[-1].capture_end()

    def replay(self, start: str | None = None, stop: str | None = None):
        """Replay the graphs from mark ``start`` (None: the first) up to mark ``stop`` (None: the last);
        returns the output (complete once the last graph has run). Without graphs: ``fn`` on the fields."""
        if stop is None:
            self.ends += 1
        if self.pool_replays is not None:
            self.pool_replays[0] += 1
        if not self.graphs:
            return self.fn(self.inputs.device)
        for graph in self.graphs[self.marks[start] if start else 0:self.marks[stop] if stop else None]:
            graph.replay()
        return self.out


class _KeyedGraphs:
    """Captured steps by key, sharing one memory pool, with the bucket rules of ``step_buffers.py``."""

    def __init__(self, pools: CachePools, *, max_seqs: int, max_pages: int):
        self.pools, self.device, self.page_size = pools, pools.device, pools.page_size
        self.max_seqs, self.max_pages = max_seqs, max_pages
        self.sizes = buckets(max_seqs)
        self.graphs: dict[GraphKey, CapturedStep] = {}
        self.mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def key_for(self, num_seqs: int, rows_per_seq: int, pages: int, is_verify: bool) -> GraphKey | None:
        """The key a uniform step replays with, or None when it must run eagerly."""
        if num_seqs > self.max_seqs or pages > self.max_pages:
            return None
        bucket = next(b for b in self.sizes if b >= num_seqs)
        return GraphKey(bucket, rows_per_seq, page_bucket(pages, self.max_pages), is_verify)

    def _padding(self, key: GraphKey, *, decode: bool, early: Collection[str] = ()) -> StaticInputs:
        """Static inputs for ``key``, filled with an all-padding batch (what the capture runs on)."""
        inputs = StaticInputs(field_sizes(key, decode=decode), self.device, early=early)
        host = inputs.begin_fill()
        if decode:
            fill_batch(host, key, starts=[], slots=[], tables=[], logits_rows=[], page_size=self.page_size)
        else:
            fill_values(host.state_slots, (), PAD_SLOT)
            fill_tables(host, key, [])
            fill_values(host.draft_limits, (), key.rows_per_seq - 1)
        fill_sampling(host, [])
        inputs.upload()
        return inputs


class TargetGraphs(_KeyedGraphs):
    """Captured target forwards over the pools (decode, or a verify's forward).

    Beside the batch fields each graph's upload carries the rows' tokens and, for a decode, the requests'
    sampling parameters and draw positions: the step's only host-to-device copy (a copy from pageable memory
    costs the host tens of microseconds while the GPU waits). A decode's key carries its batch's sampling
    summary (``graph_summary``) and its capture draws the next tokens after the forward, so a sampled decode
    step is one replay like a greedy one (the filter's and the draw's launches are inside it).
    """

    def __init__(self, target: FastTarget, pools: CachePools, *, max_seqs: int, max_pages: int):
        super().__init__(pools, max_seqs=max_seqs, max_pages=max_pages)
        self.target = target
        # tensor parallelism: called with (graphs, key, host tokens, run's keywords) before each replay
        # (TPWorkers.graph_run: the other ranks replay their own capture of the key, its collectives paired with
        # this one's); None at tp=1
        self.before_run: Callable[..., None] | None = None

    def run(self, key: GraphKey, tokens: Tensor | Sequence[int], *, starts: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]], logits_rows: Sequence[int],
            sampling: tuple[Sequence[SamplingParams], Sequence[int]] | None = None
            ) -> tuple[ForwardBatch, FastOutput, Tensor | None]:
        """One replay for ``len(starts)`` sequences of ``key.rows_per_seq`` rows each (``fill_batch``'s host
        inputs). ``tokens``: the rows' ids, host ints (uploaded with the rest) or a device tensor ``[n]`` (copied
        after the upload). ``sampling`` (a decode): the requests' parameters and the positions their next tokens
        are drawn at (also for :meth:`sampling_views`). Returns the real sequences' batch and outputs, and for a
        key with a sampling summary (a decode) each request's next token ``[B]``, drawn in the same replay: views
        of static memory, valid until the next replay."""
        if self.before_run is not None:  # the other ranks first: a capture's warm-up runs hold collectives too
            host_tokens = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
            self.before_run(self, key, host_tokens, dict(starts=list(starts), slots=list(slots),
                                                         tables=[list(t) for t in tables],
                                                         logits_rows=list(logits_rows), sampling=sampling))
        step = self.graphs.get(key) or self._capture(key)
        host = step.inputs.begin_fill()
        fill_batch(host, key, starts=starts, slots=slots, tables=tables, logits_rows=logits_rows,
                   page_size=self.page_size)
        on_device = isinstance(tokens, Tensor) and tokens.device.type != "cpu"
        if not on_device:
            fill_values(host.tokens, tokens, 0)
        if sampling is not None:
            params, positions = sampling
            fill_sampling(host, params)
            fill_values(host.sample_positions, positions, 0)
        step.inputs.upload()
        n, m = len(tokens), len(logits_rows)
        if on_device:
            step.inputs.device.tokens[:n].copy_(tokens)
        batch, out, sampled = step.replay()
        return (real_rows(batch, len(starts), n, m), FastOutput(out.logits[:m], out.hidden[:n], out.taps[:n]),
                None if sampled is None else sampled[:len(starts)])

    def sampling_views(self, key: GraphKey, num_seqs: int, summary: HostSummary) -> tuple[SamplingTensors, Tensor]:
        """The sampling parameters and draw positions the last ``run`` of ``key`` uploaded, as device views
        of its first ``num_seqs`` requests (valid until that graph's next fill)."""
        fields = self.graphs[key].inputs.device
        st = SamplingTensors(fields.temperature[:num_seqs], fields.top_k[:num_seqs], fields.top_p[:num_seqs],
                             fields.seeds[:num_seqs], summary)
        return st, fields.sample_positions[:num_seqs]

    def _capture(self, key: GraphKey) -> CapturedStep:
        inputs = self._padding(key, decode=True)

        def forward(fields: StepFields):
            batch = batch_view(fields, key, fields.tokens)
            out = self.target.forward(batch, self.pools)
            sampled = None
            if key.sampling is not None:  # a decode: the next tokens too, so sampling launches nothing more
                st = SamplingTensors(fields.temperature, fields.top_k, fields.top_p, fields.seeds, key.sampling)
                sampled = sample_next(out.logits, st, fields.sample_positions)
            return batch, out, sampled

        step = CapturedStep(inputs, forward, self.device, self.mempool)
        self.graphs[key] = step
        return step


class StepGraphs(_KeyedGraphs):
    """Captured whole speculative steps of a :class:`SpeculativeStep`, each replayed as one ``[B, 1 + R]`` result
    (``[num_accepted, *emitted]`` per request); split and proposing ahead as the module docstring says."""

    def __init__(self, spec: SpeculativeStep, *, max_seqs: int, max_pages: int, propose_ahead: bool = True):
        super().__init__(spec.pools, max_seqs=max_seqs, max_pages=max_pages)
        self.spec = spec
        self.split_after_propose = not spec.proposer.reads_block_tables
        self.pool_replays = [0]  # replays of any graph in this pool (CapturedStep counts them)
        self.on_device: dict[GraphKey, tuple[int, tuple]] = {}  # key -> (its ends, the proposal fields it holds)
        self.ahead = ProposeAhead(enabled=propose_ahead)
        self.reuse_proposal_fields = True  # off: every step fills and uploads them (A/B diagnostics)
        self.field_reuses = 0  # steps that found their proposal fields on the device (tests, diagnostics)
        # a step launched before the one before it was read (overlap scheduling): its key, requests and output
        self.in_flight: tuple[GraphKey, int, Tensor] | None = None
        self.launched_ahead = 0  # steps so launched (tests, diagnostics)

    def run(self, key: GraphKey, *, anchors: Sequence[int], slots: Sequence[int], tables: Sequence[Sequence[int]],
            anchor_tokens: Sequence[int], params: Sequence[SamplingParams], ks: Sequence[int] | None = None,
            epoch: int = 0, ahead: bool = False, next_tables: Sequence[Sequence[int]] | None = None
            ) -> list[list[int]]:
        """One replay for ``len(anchors)`` requests (host inputs as ``fill_batch``'s); ``ks``: the drafts each
        verifies, at most the key's k (None: k each). Returns, per request,
        ``[num_accepted, *emitted]``: the step's one device-to-host read. ``epoch``: the runner's step count
        (``propose_ahead.py``); ``ahead``: the caller expects the same requests to go on, so the step may launch
        the next step's proposal (a split step only). ``next_tables`` (every request drafting k now and next):
        launch the whole next step of the same requests, on these page tables, before reading this one
        (:meth:`collect` reads it)."""
        assert self.in_flight is None, "a step launched ahead must be collected first"
        step = self.graphs.get(key) or self._capture(key)
        host = step.inputs.begin_fill()
        num_seqs = len(anchors)
        # the mark is captured for every proposer (the step function cuts there); only one that reads
        # neither the block tables nor the other batch fields may run before they are uploaded
        split = self.split_after_propose and PROPOSED in step.marks
        if split:  # the proposal's fields, then its graphs, while the host goes on with the batch
            wanted = (tuple(anchors), tuple(anchor_tokens), tuple(slots),
                      tuple((p.temperature, p.top_k, p.top_p, p.seed) for p in params))
            if not self.ahead.claim(key, self.pool_replays[0], epoch, wanted):
                if self.reuse_proposal_fields and self.on_device.get(key) == (step.ends, wanted):
                    self.field_reuses += 1  # the last replay left exactly these in the proposal fields
                else:
                    self._fill_requests(host, anchors, anchor_tokens, params)
                    fill_values(host.state_slots, slots, PAD_SLOT)
                    step.inputs.upload("early")
                step.replay(stop=PROPOSED)
        else:
            self._fill_requests(host, anchors, anchor_tokens, params)
            fill_values(host.state_slots, slots, PAD_SLOT)
        fill_tables(host, key, tables)
        fill_values(host.draft_limits, ks if ks is not None else (), key.rows_per_seq - 1)
        step.inputs.upload("late" if split else "all")
        out = step.replay(start=PROPOSED if split else None)
        if next_tables is not None:
            return self._read_running_next(step, out, key, num_seqs, next_tables)
        if not split:
            return out[:num_seqs].tolist()
        launch = self.ahead.should_launch(ahead)
        rows = self._read_proposing_ahead(step, out, num_seqs) if launch else out[:num_seqs].tolist()
        # what the step's end wrote to the proposal fields (advance_proposal_fields)
        advanced = (tuple(a + row[0] + 1 for a, row in zip(anchors, rows)),
                    tuple(row[1 + row[0]] for row in rows), wanted[2], wanted[3])
        self.on_device[key] = (step.ends, advanced)
        self.ahead.expect(Prediction(key, self.pool_replays[0], epoch, advanced), launch)
        return rows

    @staticmethod
    def _fill_requests(host: StepFields, anchors, anchor_tokens, params) -> None:
        fill_values(host.anchor_tokens, anchor_tokens, 0)
        fill_values(host.anchors, anchors, 0)
        fill_sampling(host, params)

    def collect(self, next_tables: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """The rows of the step launched ahead (``run``'s ``next_tables``), as ``run`` returns them; with
        ``next_tables``, the step after it is launched first, on those tables, before this one is read."""
        key, num_seqs, out = self.in_flight
        self.in_flight = None
        if next_tables is not None:
            return self._read_running_next(self.graphs[key], out, key, num_seqs, next_tables)
        return out[:num_seqs].tolist()

    def _read_running_next(self, step: CapturedStep, out: Tensor, key: GraphKey, num_seqs: int,
                           tables: Sequence[Sequence[int]]) -> list[list[int]]:
        """The step's rows, read after launching the whole next step behind it (overlap scheduling): its proposal
        fields are the ones this step's end advanced (already on the device), its page tables ``tables``, every
        request verifying k. Its output is the static one this step wrote, so this step's is copied out first."""
        self._copy_out(step, out)
        host = step.inputs.begin_fill()
        fill_tables(host, key, tables)
        fill_values(host.draft_limits, (), key.rows_per_seq - 1)
        step.inputs.upload("late")
        self.in_flight = (key, num_seqs, step.replay())
        self.launched_ahead += 1
        # the next plain ``run`` fills every field again: nothing it could reuse is known on the host
        self.on_device.pop(key, None)
        self.ahead.forget()
        return self._read_copy(step, num_seqs)

    def _read_proposing_ahead(self, step: CapturedStep, out: Tensor, num_seqs: int) -> list[list[int]]:
        """The step's rows, read after launching the next step's proposal behind it (module docstring)."""
        self._copy_out(step, out)
        step.replay(stop=PROPOSED)  # on the proposal fields the step's end advanced
        return self._read_copy(step, num_seqs)

    def _copy_out(self, step: CapturedStep, out: Tensor) -> None:
        """Start copying the step's output to its pinned twin (made on first use), marking when it has landed."""
        if step.result is None:
            cuda = self.device.type == "cuda"
            step.result = torch.empty(out.shape, dtype=out.dtype, pin_memory=cuda)
            step.result_ready = torch.cuda.Event() if cuda else None
        step.result.copy_(out, non_blocking=True)
        if step.result_ready is not None:
            step.result_ready.record()

    @staticmethod
    def _read_copy(step: CapturedStep, num_seqs: int) -> list[list[int]]:
        if step.result_ready is not None:
            step.result_ready.synchronize()  # the step's own graphs and the copy, not what was launched behind them
        return step.result[:num_seqs].tolist()

    def _capture(self, key: GraphKey) -> CapturedStep:
        # the proposal's fields lead the buffer for every proposer: a split step uploads them first, and a step
        # launched ahead (overlap scheduling) uploads only the rest, keeping the ones the step before advanced
        inputs = self._padding(key, decode=False, early=PROPOSAL_FIELDS)

        def step_fn(fields: StepFields):
            num_accepted, emitted = self._step(fields, key)
            advance_proposal_fields(fields, num_accepted, emitted)
            return torch.cat([num_accepted[:, None], emitted], dim=1)  # [B, 1 + R]: one read of both

        step = CapturedStep(inputs, step_fn, self.device, self.mempool, self.pool_replays)
        self.graphs[key] = step
        return step

    def _step(self, fields: StepFields, key: GraphKey) -> tuple[Tensor, Tensor]:
        """One speculative step over the static fields of ``key``: the proposal, a cut, then the rest."""
        b, k = key.num_seqs, key.rows_per_seq - 1
        st = SamplingTensors(fields.temperature, fields.top_k, fields.top_p, fields.seeds, key.sampling)
        # a proposer that does not read the block tables runs before they are uploaded (split steps)
        tables = None if self.split_after_propose else fields.block_tables.view(b, key.pages).to(torch.int32)
        proposal = self.spec.propose(fields.anchor_tokens, fields.anchors, fields.state_slots, tables, k, st)
        graph_cut(PROPOSED)  # the capture goes on in a new graph at each stage (fast/model/capture.py)
        token_ids = torch.cat([fields.anchor_tokens[:, None], proposal.tokens], dim=1).reshape(-1)
        batch = batch_view(fields, key, token_ids, speculative_rows(fields, key, self.page_size))
        return self.spec.verify_uniform(batch, proposal, st, fields.anchors, fields.draft_limits)


def advance_proposal_fields(fields: StepFields, num_accepted: Tensor, emitted: Tensor) -> None:
    """At a speculative step's end, what the host will ask for next: each real request's (state slot >= 0) anchor
    moves past its num_accepted + 1 committed tokens and its anchor token becomes the last of them,
    ``emitted[b, num_accepted[b]]``; padding requests keep theirs."""
    real = fields.state_slots >= 0
    last = emitted.gather(1, num_accepted[:, None])[:, 0]
    fields.anchor_tokens.copy_(torch.where(real, last, fields.anchor_tokens))
    fields.anchors.copy_(torch.where(real, fields.anchors + num_accepted + 1, fields.anchors))


def graph_summary(params: Sequence[SamplingParams]) -> HostSummary:
    """The batch's HostSummary with max_top_k rounded up to a power of two (at least 16): a summary may
    only err towards more work, and the rounding keeps the number of captured step graphs small."""
    summary = HostSummary.of(params)
    if summary.max_top_k <= 0:
        return summary
    return replace(summary, max_top_k=max(16, 1 << (summary.max_top_k - 1).bit_length()))
