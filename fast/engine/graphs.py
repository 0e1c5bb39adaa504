"""CUDA graphs of the engine's decode and verify steps: static buffers per bucket, one upload per step (two for
a DFlash step: its proposal's fields first, ``StepGraphs``; one, the rest, for a steady step whose proposal the
step before launched).

Launched eagerly, a decode or verify step of a 40-64-layer hybrid is hundreds to thousands of
small kernels, and at a few requests their launch gaps cost more than the weights' bytes. Here each
step shape is captured once (as a few CUDA graphs, below) and replayed:

- ``TargetGraphs``: the target forward alone (plain decode: one row per request; also a verify's
  forward when the whole step cannot be captured);
- ``StepGraphs``: a whole speculative step, propose -> target verify forward -> verify ->
  ``commit_verify`` -> observe, as one capture (``ModelRunner.verify_step_fn`` builds it), greedy and
  sampled alike (the key carries the batch's sampling summary, which fixes the filter's launches).

A capture is a few CUDA graphs replayed back to back, cut between stages and between layers (two
short graphs first, then layer groups: fast/model/capture.py), so the host's launch of one overlaps
the GPU's run of the one before.

Keys: ``(B bucket, rows per sequence R, page-table width bucket P, is_verify)``; the B bucket is the
smallest of 1, 2, 4, 8, ... (capped at max_running_req) that holds the batch, the P bucket the next
power of two of the pages any sequence needs (at least MIN_PAGES, capped at the model's maximum).

Each graph owns static inputs (:class:`StaticInputs`): named int64 and fp32 fields that the host
fills (numpy) in two pinned buffers and uploads with one non-blocking copy each (a DFlash step: the
early fields' part of each, then the rest). The ForwardBatch fields
(positions, cu_seqlens, state slots, K/V slots, page tables, context lengths, logits rows) follow
``fast/model/batch.py``'s padding: padding sequences have R rows each, state slot and K/V slots
``PAD_SLOT`` (they read the zero state, write the trash slot and row), no pages and context length
0, so they change nothing a real row reads; their outputs are computed and dropped.

Capture happens on first use of a key, on all-padding inputs (the warm-up runs and the capture then
touch only the trash slot and row), so no step runs twice. All graphs share one memory pool: they
replay one at a time, and each step's outputs are read before the next replay (or, a step that launches
the next proposal ahead, copied out first: ``StepGraphs``). A step that fits no
graph (a prefill chunk, a verify whose requests draft different k, more requests than
max_running_req, a traced step, CPU tensors, or ops that synchronise with the host) runs eagerly;
``enforce_eager`` runs every step eagerly.

Eager and replay compute the same padded batch with the same kernels, so their outputs are equal
bit for bit (``conformance/gpu/test_cuda_graphs.py``); an unpadded eager step may differ in
rounding, since GEMM kernels are chosen by row count.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dflash2.reference.request.sampling_params import SamplingParams

from ..kernels.sampling.philox import seed_bits
from ..kernels.sampling.sampler import HostSummary, SamplingTensors
from ..model.batch import PAD_SLOT, ForwardBatch
from ..model.capture import cutting
from ..model.target import FastOutput, FastTarget

MIN_PAGES = 16


def buckets(max_seqs: int) -> list[int]:
    """Batch-size buckets: powers of two below ``max_seqs``, then ``max_seqs`` itself."""
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_seqs]


def page_bucket(pages: int, max_pages: int) -> int:
    """The page-table width a step of ``pages`` pages replays with: a power of two, capped at ``max_pages``."""
    width = MIN_PAGES
    while width < pages:
        width *= 2
    return min(width, max_pages)


def kv_slot_mapping(tables, seq, positions, page_size: int):
    """Flat K/V slot of each row: page ``tables[seq, p // page_size]``, offset ``p % page_size``  # [N].
    Tensors (the eager batch) or numpy arrays (the graphs' host fill) alike."""
    return tables[seq, positions // page_size] * page_size + positions % page_size


@dataclass(frozen=True)
class GraphKey:
    num_seqs: int  # B bucket
    rows_per_seq: int  # R: 1 for decode, k+1 for verify
    pages: int  # page-table width P
    is_verify: bool
    sampling: object = None  # a whole step's HostSummary (which verify kernels can have work), rounded up
    simulated: bool = False  # benchmarks only: the step's acceptance is the ``keep`` field's (runner.simulated_accept)


class StaticInputs:
    """Named fixed-size device fields (int64 and fp32) in one byte buffer, filled from a pinned host twin.

    The host twins are numpy views of the pinned buffer: a step's fill is a few numpy writes of
    microseconds each, where torch's CPU ops cost several microseconds of dispatch apiece and, on the
    step's critical path, kept the GPU waiting (bench/results/2026-12-01-h200-perf3/). One buffer, laid
    out as early int64, early fp32, late int64, late fp32 fields (each 8-byte aligned), makes each
    upload one copy of a range sliced once here: the H200 profile of a verify step had 4 copies and
    their slicing at ~100 us of host time a step (bench/results/2026-12-01-h200-perf5/, timeline).
    """

    def __init__(self, int_fields: dict[str, int], float_fields: dict[str, int], device: torch.device,
                 early: Collection[str] = ()):
        self.views: dict[str, Tensor] = {}
        self.host: dict[str, np.ndarray] = {}
        groups = [(name, n, dtype) for is_early in (True, False)
                  for dtype, fields in ((torch.long, int_fields), (torch.float32, float_fields))
                  for name, n in fields.items() if (name in early) == is_early]
        offsets, nbytes, early_end = [], 0, 0
        for name, n, dtype in groups:
            offsets.append(nbytes)
            nbytes += -(-n * dtype.itemsize // 8) * 8  # the next field 8-byte aligned
            if name in early:
                early_end = nbytes
        cuda = device.type == "cuda"
        device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        host_buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
        host_np = host_buf.numpy()
        for (name, n, dtype), at in zip(groups, offsets):
            size = n * dtype.itemsize
            self.views[name] = device_buf[at:at + size].view(dtype)
            self.host[name] = host_np[at:at + size].view(np.int64 if dtype == torch.long else np.float32)
        # (device range, host range) per part, sliced once (a slice costs the host microseconds a step)
        self._parts = {part: (device_buf[lo:hi], host_buf[lo:hi])
                       for part, (lo, hi) in {"all": (0, nbytes), "early": (0, early_end),
                                              "late": (early_end, nbytes)}.items()}
        self._uploaded = torch.cuda.Event() if cuda else None

    def begin_fill(self) -> dict[str, np.ndarray]:
        """The host fields to write (after the previous upload has left the pinned buffers)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        return self.host

    def upload(self, part: str = "all") -> None:
        """Copy the host fields to the device: ``"all"``, or the ``"early"`` fields (a step's first
        graphs read only those) and later the ``"late"`` rest, whose host twins may still be written
        while the early copy is in flight (they are other bytes). One copy either way."""
        device_range, host_range = self._parts[part]
        if device_range.numel():
            device_range.copy_(host_range, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()


def batch_fields(key: GraphKey) -> dict[str, int]:
    b, r = key.num_seqs, key.rows_per_seq
    return {"positions": b * r, "cu_seqlens": b + 1, "state_slots": b, "kv_slot_mapping": b * r,
            "block_tables": b * key.pages, "context_lens": b, "logits_rows": b * r}


def fill_batch(host: dict[str, np.ndarray], key: GraphKey, *, starts: Sequence[int], slots: Sequence[int] | None,
               tables: Sequence[Sequence[int]], logits_rows: Sequence[int], page_size: int) -> None:
    """Write the padded ForwardBatch fields of ``len(starts)`` real sequences of R rows each (not the tokens).

    starts, slots: B' ints; tables: B' rows of page ids (a sequence's pages in order, at most P; -1 pads);
    logits_rows: M ints (padded with every row after them). Lists, numpy arrays or CPU tensors.
    ``slots=None`` leaves ``state_slots`` as written before (a step that uploaded it early).
    """
    b, r, p = key.num_seqs, key.rows_per_seq, key.pages
    starts = np.asarray(starts, dtype=np.int64)
    num_seqs = starts.size
    n_real = num_seqs * r
    positions = (starts[:, None] + np.arange(r)).reshape(-1)  # [n_real]
    host["positions"][:] = 0
    host["positions"][:n_real] = positions
    host["cu_seqlens"][:] = np.arange(b + 1) * r
    if slots is not None:
        host["state_slots"][:] = PAD_SLOT
        host["state_slots"][:num_seqs] = np.asarray(slots, dtype=np.int64)
    table = host["block_tables"].reshape(b, p)
    table[:] = PAD_SLOT
    for i, pages in enumerate(tables):
        pages = np.asarray(pages, dtype=np.int64)
        table[i, :pages.size] = pages
    host["kv_slot_mapping"][:] = PAD_SLOT
    if num_seqs:
        seq = np.repeat(np.arange(num_seqs), r)
        host["kv_slot_mapping"][:n_real] = kv_slot_mapping(table, seq, positions, page_size)
    host["context_lens"][:] = 0
    host["context_lens"][:num_seqs] = starts + r
    logits_rows = np.asarray(logits_rows, dtype=np.int64)
    host["logits_rows"][:] = np.arange(b * r)
    host["logits_rows"][:logits_rows.size] = logits_rows


def fill_per_request(host: dict[str, np.ndarray], fields: Mapping[str, tuple[Sequence, float]]) -> None:
    """Per-request fields ``name -> (values of the B' real requests, padding value)``."""
    for name, (values, pad) in fields.items():
        values = np.asarray(values, dtype=host[name].dtype)
        host[name][:] = pad
        host[name][:values.size] = values


def batch_view(views: dict[str, Tensor], key: GraphKey, token_ids: Tensor) -> ForwardBatch:
    """The ForwardBatch over the static fields (its int32 casts run inside the graph, so they replay too)."""
    return ForwardBatch(
        token_ids=token_ids, positions=views["positions"], cu_seqlens=views["cu_seqlens"].to(torch.int32),
        state_slots=views["state_slots"], kv_slot_mapping=views["kv_slot_mapping"],
        block_tables=views["block_tables"].view(key.num_seqs, key.pages).to(torch.int32),
        context_lens=views["context_lens"], is_verify=key.is_verify, logits_rows=views["logits_rows"],
        max_query_len=key.rows_per_seq)


def real_rows(batch: ForwardBatch, num_seqs: int, num_rows: int, num_logits: int) -> ForwardBatch:
    """The first ``num_seqs`` sequences (``num_rows`` rows) of a padded batch, as views."""
    return ForwardBatch(token_ids=batch.token_ids[:num_rows], positions=batch.positions[:num_rows],
                        cu_seqlens=batch.cu_seqlens[:num_seqs + 1], state_slots=batch.state_slots[:num_seqs],
                        kv_slot_mapping=batch.kv_slot_mapping[:num_rows], block_tables=batch.block_tables[:num_seqs],
                        context_lens=batch.context_lens[:num_seqs], is_verify=batch.is_verify,
                        logits_rows=batch.logits_rows[:num_logits], max_query_len=batch.max_query_len)


class CapturedStep:
    """``fn(views)`` captured once over ``inputs`` (all padding when captured); ``replay`` reruns it.

    The capture is cut into several graphs where ``fn`` calls ``fast/model/capture.graph_cut`` (the
    target and the draft at ``capture.layer_cuts``, a speculative step between its stages): replayed back to back,
    each graph's host launch overlaps the GPU's run of the one before (that module's docstring).
    On a CPU device nothing is captured and ``replay`` calls ``fn`` on the static fields: the same
    buffers and padding, so the CPU lane tests everything here but the capture itself.
    """

    def __init__(self, inputs: StaticInputs, fn: Callable[[dict[str, Tensor]], object], device: torch.device,
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
                fn(inputs.views)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)

        def begin() -> None:
            self.graphs.append(torch.cuda.CUDAGraph())
            self.graphs[-1].capture_begin(pool=mempool)

        def cut(mark: str | None) -> None:
            self.graphs[-1].capture_end()
            if mark is not None:
                self.marks[mark] = len(self.graphs)
            begin()

        with torch.cuda.stream(torch.cuda.Stream(device)):
            begin()
            try:
                with cutting(cut):
                    self.out = fn(inputs.views)
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
            return self.fn(self.inputs.views)
        for graph in self.graphs[self.marks[start] if start else 0:self.marks[stop] if stop else None]:
            graph.replay()
        return self.out


class _KeyedGraphs:
    """Graphs by key, sharing one memory pool, with the bucket rules of the module docstring."""

    def __init__(self, pools, *, max_seqs: int, max_pages: int):
        self.pools, self.device, self.page_size = pools, pools.device, pools.page_size
        self.max_seqs, self.max_pages = max_seqs, max_pages
        self.sizes = buckets(max_seqs)
        self.graphs: dict = {}
        self.mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def key_for(self, num_seqs: int, rows_per_seq: int, pages: int, is_verify: bool) -> GraphKey | None:
        """The key a uniform step replays with, or None when it must run eagerly."""
        if num_seqs > self.max_seqs or pages > self.max_pages:
            return None
        bucket = next(b for b in self.sizes if b >= num_seqs)
        return GraphKey(bucket, rows_per_seq, page_bucket(pages, self.max_pages), is_verify)

    def _padding(self, key: GraphKey, extra_int: dict[str, int], extra_float: dict[str, int],
                 early: Collection[str] = ()) -> StaticInputs:
        """Static inputs for ``key``, filled with an all-padding batch (what the capture runs on)."""
        inputs = StaticInputs({**batch_fields(key), **extra_int}, extra_float, self.device, early=early)
        fill_batch(inputs.begin_fill(), key, starts=[], slots=[], tables=[], logits_rows=[], page_size=self.page_size)
        inputs.upload()
        return inputs


SAMPLING_INT_FIELDS = ("sample_positions", "top_k", "seeds")
SAMPLING_FLOAT_FIELDS = ("temperature", "top_p")


def sampling_fields(params: Sequence[SamplingParams]) -> dict[str, tuple[list, float]]:
    """The per-request sampling fields of ``params`` and their padding (padding requests are greedy)."""
    return {"temperature": ([sp.temperature for sp in params], 0.0), "top_k": ([sp.top_k for sp in params], -1),
            "top_p": ([sp.top_p for sp in params], 1.0), "seeds": (seed_bits(sp.seed for sp in params), 0)}


class TargetGraphs(_KeyedGraphs):
    """Captured target forwards over the pools (decode, or a verify's forward).

    Beside the batch fields each graph's upload carries the rows' tokens and, for a decode, the
    requests' sampling parameters and draw positions: the step's only host-to-device copy (a copy
    from pageable memory costs the host tens of microseconds while the GPU waits).
    """

    def __init__(self, target, pools, *, max_seqs: int, max_pages: int):
        super().__init__(pools, max_seqs=max_seqs, max_pages=max_pages)
        self.target = target

    def run(self, key: GraphKey, tokens: Tensor | Sequence[int], *, starts: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]], logits_rows: Sequence[int],
            sampling: tuple[Sequence[SamplingParams], Sequence[int]] | None = None) -> tuple[ForwardBatch, FastOutput]:
        """One replay for ``len(starts)`` sequences of ``key.rows_per_seq`` rows each (``fill_batch``'s
        host inputs). ``tokens``: the rows' ids, host ints (uploaded with the rest) or a device tensor
        ``[n]`` (copied after the upload). ``sampling`` (a decode): the requests' parameters and the
        positions their next tokens are drawn at, for :meth:`sampling_views`. Returns the real sequences'
        batch and outputs: views of static memory, valid until the next replay."""
        step = self.graphs.get(key) or self._capture(key)
        host = step.inputs.begin_fill()
        fill_batch(host, key, starts=starts, slots=slots, tables=tables, logits_rows=logits_rows,
                   page_size=self.page_size)
        on_device = isinstance(tokens, Tensor) and tokens.device.type != "cpu"
        if not on_device:
            fill_per_request(host, {"tokens": (tokens, 0)})
        if sampling is not None:
            params, positions = sampling
            fill_per_request(host, {**sampling_fields(params), "sample_positions": (positions, 0)})
        step.inputs.upload()
        n, m = len(tokens), len(logits_rows)
        if on_device:
            step.tokens[:n].copy_(tokens)
        batch, out = step.replay()
        return real_rows(batch, len(starts), n, m), FastOutput(out.logits[:m], out.hidden[:n], out.taps[:n])

    def sampling_views(self, key: GraphKey, num_seqs: int, summary: HostSummary) -> tuple[SamplingTensors, Tensor]:
        """The sampling parameters and draw positions the last ``run`` of ``key`` uploaded, as device views
        of its first ``num_seqs`` requests (valid until that graph's next fill)."""
        views = self.graphs[key].inputs.views
        st = SamplingTensors(views["temperature"][:num_seqs], views["top_k"][:num_seqs], views["top_p"][:num_seqs],
                             views["seeds"][:num_seqs], summary)
        return st, views["sample_positions"][:num_seqs]

    def _capture(self, key: GraphKey) -> CapturedStep:
        b = key.num_seqs
        inputs = self._padding(key, {"tokens": b * key.rows_per_seq, **{name: b for name in SAMPLING_INT_FIELDS}},
                               {name: b for name in SAMPLING_FLOAT_FIELDS})
        tokens = inputs.views["tokens"]

        def forward(views):
            batch = batch_view(views, key, tokens)
            return batch, self.target.forward(batch, self.pools)

        step = CapturedStep(inputs, forward, self.device, self.mempool)
        step.tokens = tokens
        self.graphs[key] = step
        return step


REQUEST_INT_FIELDS = ("anchor_tokens", "anchors", "top_k", "seeds", "keep")
EARLY_REQUEST_FIELDS = ("anchor_tokens", "anchors", "top_k", "seeds", "temperature", "top_p")  # what a proposal reads
# (with state_slots); keep, read by the verify only, goes with the late fields
PROPOSED = "proposed"  # the graph_cut mark after a speculative step's proposal
# StepGraphs proposes ahead while its prediction of the next step held for AHEAD_MIN_HITS of the last
# AHEAD_WINDOW steps: at one request a proposal ahead saves ~0.27 ms a step and a dropped one costs its
# ~0.87 ms (H200, MoE 35B-A3B, perf11), so it pays while about 3 in 4 are used
AHEAD_WINDOW = 8
AHEAD_MIN_HITS = 6
REQUEST_FLOAT_FIELDS = ("temperature", "top_p")


class StepGraphs(_KeyedGraphs):
    """Captured whole speculative steps: ``step_fn(views, key) -> (num_accepted [B], emitted [B, R])``,
    replayed as one ``[B, 1 + R]`` tensor.

    Per-request fields beside the batch: anchor token and position, sampling parameters (temperature,
    top-k, top-p, seed; padding requests are greedy) and, for benchmarks only, ``keep`` (the drafts a
    simulated verify keeps).

    ``split_after_propose`` (a proposer that reads only the per-request fields and ``state_slots``:
    DFlash): ``step_fn`` marks the end of its proposal with ``graph_cut(PROPOSED)``, and a replay
    uploads those fields, launches the proposal's graphs, and only then fills and uploads the rest of
    the batch and launches the verify's, so the host's fill of the batch runs while the GPU drafts
    instead of before (on the H200 the GPU waited about 290 us of host work per MoE verify step,
    bench/results/2026-12-01-h200-perf3/call3-hostsplit-moe-dflash7.txt).

    Steady state (split steps): the step's graph ends by advancing its own early fields as the host will
    for the next step (each real request's anchor by its committed tokens, its anchor token to the last
    one emitted), and ``run`` remembers what the device then holds. When the next step of that key asks
    for exactly those values (same anchors, tokens, slots and sampling parameters) and nothing else
    replayed the step since, it launches the proposal at once, without the early fill and upload
    (otherwise it fills and uploads them, as on every first step). Alone this measured no faster on the
    H200 (7500 against 7491 us a step, perf11's A/B, within its spread); what pays is the next part.

    Proposal ahead (``run(..., ahead=True)``, when the caller expects the same requests to go on): the
    step also launches the next step's proposal on those advanced fields, right behind its own graphs
    and before it reads its result (copied first into a pinned buffer, so the proposal cannot overwrite
    it in the shared pool). The GPU then drafts step n + 1 while the host reads step n's tokens, the
    engine commits them and the next ``run`` fills and uploads the rest of the batch: no host lead at
    all (H200, MoE 35B-A3B, one request: 7234 against 7500 us a step, perf11). That next ``run`` uses
    the proposal only if nothing can have changed what it read: the same key, exactly the advanced
    values, no replay of any graph of this pool since (``pool_replays``), and no other runner step in
    between (``epoch``, which the runner counts up once per step: a prefill, a decode or an eager verify
    could write the rings the proposal read). A DFlash proposal writes no state (it reads the rings and
    its fields; its outputs are the pool's), so a proposal nobody uses costs only its GPU time, and the
    next step proposes again, as without one. That waste is why a step proposes ahead only while the
    prediction held for at least :data:`AHEAD_MIN_HITS` of the last :data:`AHEAD_WINDOW` steps (checked
    on every step, launched or not): a batch whose requests finish or join often (end of sequence,
    arrivals) stops paying for proposals it drops, and takes them up again once it is steady.
    """

    def __init__(self, pools, step_fn: Callable, *, max_seqs: int, max_pages: int, split_after_propose: bool = False):
        super().__init__(pools, max_seqs=max_seqs, max_pages=max_pages)
        self.step_fn = step_fn
        self.split_after_propose = split_after_propose
        self.pool_replays = [0]  # replays of any graph in this pool (CapturedStep counts them)
        self.on_device: dict[GraphKey, tuple[int, tuple]] = {}  # key -> (its ends, the early values it holds)
        self.expected: tuple | None = None  # (key, pool_replays, epoch, early values) the next step should ask for
        self.launched_ahead = False  # whether the last step launched the proposal for ``expected``
        self.recent_hits: deque[bool] = deque(maxlen=AHEAD_WINDOW)  # whether ``expected`` held, per step
        self.propose_ahead = os.environ.get("DFLASH2_PROPOSE_AHEAD", "1") != "0"  # off: never launch one
        self.reuse_early_fields = True  # off: every step fills and uploads them (A/B diagnostics)
        self.early_reuses = 0  # steps that found their early fields on the device (tests, diagnostics)
        self.ahead_used = 0  # steps whose proposal had been launched by the step before (tests, diagnostics)

    def run(self, key: GraphKey, *, anchors: Sequence[int], slots: Sequence[int], tables: Sequence[Sequence[int]],
            anchor_tokens: Sequence[int], params: Sequence[SamplingParams], keep: int, epoch: int = 0,
            ahead: bool = False) -> list[list[int]]:
        """One replay for ``len(anchors)`` requests (host inputs as ``fill_batch``'s; ``keep``: -1, or the
        drafts a benchmark's simulated verify keeps). Returns, per request, ``[num_accepted, *emitted]``:
        the step's one device-to-host read. ``epoch``: the runner's step count (class docstring);
        ``ahead``: also launch the next step's proposal (a split step only; class docstring)."""
        step = self.graphs.get(key) or self._capture(key)
        host = step.inputs.begin_fill()
        num_seqs = len(anchors)
        per_request = {"anchor_tokens": (anchor_tokens, 0), "anchors": (anchors, 0), **sampling_fields(params)}
        keep_field = {"keep": ([keep] * num_seqs, 0)}
        # the mark is captured for every proposer (the step function cuts there); only one that reads
        # neither the block tables nor the other batch fields may run before they are uploaded
        split = self.split_after_propose and PROPOSED in step.marks
        if split:  # the proposal's fields, then its graphs, while the host goes on with the batch
            wanted = (tuple(anchors), tuple(anchor_tokens), tuple(slots),
                      tuple((p.temperature, p.top_k, p.top_p, p.seed) for p in params))
            hit = self.expected == (key, self.pool_replays[0], epoch - 1, wanted)
            if self.expected is not None:
                self.recent_hits.append(hit)
            if hit and self.launched_ahead:
                self.ahead_used += 1  # the step before launched exactly this proposal, and nothing ran since
            else:
                if self.reuse_early_fields and self.on_device.get(key) == (step.ends, wanted):
                    self.early_reuses += 1  # the last replay left exactly these in the early fields
                else:
                    fill_per_request(host, {**per_request, "state_slots": (slots, PAD_SLOT)})
                    step.inputs.upload("early")
                step.replay(stop=PROPOSED)
            self.expected, self.launched_ahead = None, False
            fill_per_request(host, keep_field)
        else:
            fill_per_request(host, {**per_request, **keep_field})
        fill_batch(host, key, starts=anchors, slots=None if split else slots, tables=tables,
                   logits_rows=range(num_seqs * key.rows_per_seq), page_size=self.page_size)
        step.inputs.upload("late" if split else "all")
        out = step.replay(start=PROPOSED if split else None)
        if not split:
            return out[:num_seqs].tolist()
        ahead = ahead and self.propose_ahead and self.recent_hits.count(False) <= AHEAD_WINDOW - AHEAD_MIN_HITS
        rows = self._read_proposing_ahead(step, out, num_seqs) if ahead else out[:num_seqs].tolist()
        # what the step's end wrote to the early fields (_capture's advance_early_fields)
        advanced = (tuple(a + row[0] + 1 for a, row in zip(anchors, rows)),
                    tuple(row[1 + row[0]] for row in rows), wanted[2], wanted[3])
        self.on_device[key] = (step.ends, advanced)
        self.expected, self.launched_ahead = (key, self.pool_replays[0], epoch, advanced), ahead
        return rows

    def _read_proposing_ahead(self, step: CapturedStep, out: Tensor, num_seqs: int) -> list[list[int]]:
        """The step's rows, read after launching the next step's proposal behind it (class docstring)."""
        if step.result is None:  # the pinned copy the host reads, and the event that says it has landed
            cuda = self.device.type == "cuda"
            step.result = torch.empty(out.shape, dtype=out.dtype, pin_memory=cuda)
            step.result_ready = torch.cuda.Event() if cuda else None
        step.result.copy_(out, non_blocking=True)
        if step.result_ready is not None:
            step.result_ready.record()
        step.replay(stop=PROPOSED)  # on the early fields the step's end advanced
        if step.result_ready is not None:
            step.result_ready.synchronize()  # the step's own graphs and the copy, not the proposal behind them
        return step.result[:num_seqs].tolist()

    def _capture(self, key: GraphKey) -> CapturedStep:
        b = key.num_seqs
        early = (*EARLY_REQUEST_FIELDS, "state_slots") if self.split_after_propose else ()
        inputs = self._padding(key, {name: b for name in REQUEST_INT_FIELDS},
                               {name: b for name in REQUEST_FLOAT_FIELDS}, early=early)
        fill_per_request(inputs.begin_fill(), sampling_fields([]))
        inputs.upload()

        def step_fn(views):
            num_accepted, emitted = self.step_fn(views, key)
            if self.split_after_propose:
                advance_early_fields(views, num_accepted, emitted)
            return torch.cat([num_accepted[:, None], emitted], dim=1)  # [B, 1 + R]: one read of both

        step = CapturedStep(inputs, step_fn, self.device, self.mempool, self.pool_replays)
        self.graphs[key] = step
        return step


def advance_early_fields(views: dict[str, Tensor], num_accepted: Tensor, emitted: Tensor) -> None:
    """At a split step's end, what the host will ask for next (``StepGraphs``, "Steady state"): each real
    request's (state slot >= 0) anchor moves past its num_accepted + 1 committed tokens and its anchor token
    becomes the last of them, ``emitted[b, num_accepted[b]]``; padding requests keep theirs."""
    real = views["state_slots"] >= 0
    last = emitted.gather(1, num_accepted[:, None])[:, 0]
    views["anchor_tokens"].copy_(torch.where(real, last, views["anchor_tokens"]))
    views["anchors"].copy_(torch.where(real, views["anchors"] + num_accepted + 1, views["anchors"]))
