"""StepGraphs.run: the order of a captured step's uploads and graph launches, per proposer.

A captured speculative step is cut at ``graph_cut(PROPOSED)`` for every proposer. Only a proposer
that reads no batch field but the per-request ones and ``state_slots`` (DFlash) may launch its
proposal before the host fills the rest of the batch; MTP attends over the target's pages, so its
step must upload everything first. On the CPU nothing is captured, so these tests stand a recording
step in for the capture: its marks are what a CUDA capture records (perf5 on the H200 found MTP's
sampled graph steps drafting from the previous step's fields when the split ignored the proposer).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash2.fast.engine.graphs.graph_step import PROPOSED, StepGraphs, advance_proposal_fields
from dflash2.fast.engine.graphs.propose_ahead import ProposeAhead
from dflash2.fast.engine.graphs.step_buffers import PROPOSAL_FIELDS, GraphKey
from dflash2.reference.request.sampling_params import SamplingParams

KEY = GraphKey(num_seqs=2, rows_per_seq=3, pages=2, is_verify=True)
AHEAD_WINDOW, AHEAD_MIN_HITS = ProposeAhead().window, ProposeAhead().min_hits


def fake_spec(page_size: int, split: bool) -> SimpleNamespace:
    """What StepGraphs reads of a SpeculativeStep outside a capture: the pools' device and page size, and
    whether the proposer reads the block tables."""
    return SimpleNamespace(pools=SimpleNamespace(device=torch.device("cpu"), page_size=page_size),
                           proposer=SimpleNamespace(reads_block_tables=not split))


class RecordingStep:
    """A captured step's stand-in: two graphs, cut at PROPOSED; records uploads and replays with
    the device fields each replay saw."""

    def __init__(self, inputs, log, pool_replays=None):
        self.inputs, self.log, self.marks, self.ends = inputs, log, {PROPOSED: 1}, 0
        self.pool_replays, self.result = pool_replays if pool_replays is not None else [0], None
        upload = inputs.upload

        def recording_upload(part="all"):
            upload(part)
            log.append(("upload", part))
        inputs.upload = recording_upload

    def replay(self, start=None, stop=None):
        self.ends += stop is None
        self.pool_replays[0] += 1
        seen = {name: getattr(self.inputs.device, name).clone() for name in ("anchors", "block_tables")}
        self.log.append(("replay", start, stop, seen))
        return torch.zeros(KEY.num_seqs, 1 + KEY.rows_per_seq, dtype=torch.long)


def run_once(split_after_propose: bool):
    graphs = StepGraphs(fake_spec(8, split_after_propose), max_seqs=4, max_pages=2)
    inputs = graphs._padding(KEY, decode=False, early=PROPOSAL_FIELDS if split_after_propose else ())
    log: list = []
    graphs.graphs[KEY] = RecordingStep(inputs, log)
    graphs.run(KEY, anchors=[5, 9], slots=[0, 1], tables=[[3], [4, 6]], anchor_tokens=[11, 12],
               params=[SamplingParams(temperature=1.0, seed=1), SamplingParams()])
    return log


@pytest.mark.parametrize("split_after_propose", [False, True])
def test_every_replayed_graph_sees_this_steps_fields(split_after_propose):
    """Whatever the order, the proposal's fields are this step's when its graphs run, and the
    verify's graphs run with the whole batch uploaded."""
    log = run_once(split_after_propose)
    replays = [entry for entry in log if entry[0] == "replay"]
    for _, start, stop, seen in replays:
        assert seen["anchors"].tolist() == [5, 9], f"a replay from {start} to {stop} saw stale anchors"
    assert replays[-1][3]["block_tables"].view(2, 2).tolist() == [[3, -1], [4, 6]]


def test_a_proposer_that_reads_the_batch_replays_only_after_the_whole_upload():
    log = run_once(split_after_propose=False)
    assert [entry[:3] for entry in log] == [("upload", "all"), ("replay", None, None)]


def test_dflash_launches_its_proposal_before_the_batch_upload():
    log = run_once(split_after_propose=True)
    assert [entry[:3] for entry in log] == [("upload", "early"), ("replay", None, PROPOSED), ("upload", "late"),
                                            ("replay", PROPOSED, None)]


class DeviceLikeStep(RecordingStep):
    """A split step that does what the captured one does to its fields: the proposal (up to PROPOSED) records
    the anchors and anchor tokens it reads; the rest returns ``[num_accepted, *emitted]`` (request b accepts
    ``accept[b]`` drafts, emits tokens 100 * step + b + i) and advances the early fields."""

    def __init__(self, inputs, log, accept, pool_replays=None):
        super().__init__(inputs, log, pool_replays)
        self.accept, self.step = accept, 0

    def replay(self, start=None, stop=None):
        fields = self.inputs.device
        self.ends += stop is None
        self.pool_replays[0] += 1
        if start is None:  # the proposal
            self.log.append(("proposal", fields.anchors.tolist(), fields.anchor_tokens.tolist()))
        if stop is None:  # the rest of the step
            b, r = KEY.num_seqs, KEY.rows_per_seq
            num_accepted = torch.tensor(self.accept, dtype=torch.long)
            emitted = 100 * self.step + torch.arange(b)[:, None] * 10 + torch.arange(r)[None, :]
            self.step += 1
            advance_proposal_fields(fields, num_accepted, emitted)
            return torch.cat([num_accepted[:, None], emitted], dim=1)


def _split_graphs(accept):
    """A split StepGraphs whose one step (KEY) is a DeviceLikeStep accepting ``accept``, counted in the
    graphs' pool; returns (graphs, step, the step's log)."""
    graphs = StepGraphs(fake_spec(64, True), max_seqs=4, max_pages=2)
    inputs = graphs._padding(KEY, decode=False, early=PROPOSAL_FIELDS)
    log: list = []
    step = graphs.graphs[KEY] = DeviceLikeStep(inputs, log, accept=accept, pool_replays=graphs.pool_replays)
    return graphs, step, log


def test_steady_split_steps_reuse_the_proposal_fields_the_device_advanced():
    """Steps whose requests continue as the device expects skip the early fill and upload, and every
    proposal still reads this step's anchors and tokens; a host-side change, a new request mix or a replay
    from outside (a diagnostic) sends the next step back to the full upload."""
    graphs, step, log = _split_graphs(accept=[1, 0])  # request 1 is padding
    params = [SamplingParams(temperature=1.0, seed=1)]
    anchors, tokens = [5], [11]

    def run(**overrides):
        log.clear()
        args = dict(anchors=anchors, slots=[0], tables=[[3]], anchor_tokens=tokens, params=params)
        rows = graphs.run(KEY, **{**args, **overrides})
        proposal = next(entry for entry in log if entry[0] == "proposal")
        uploads = [entry[1] for entry in log if entry[0] == "upload"]
        return rows, proposal, uploads

    def host_next(rows):  # what the engine does with a step's result: move past the committed tokens
        accepted = rows[0][0]
        return [anchors[0] + accepted + 1], [rows[0][1 + accepted]]

    rows, proposal, uploads = run()
    assert uploads == ["early", "late"] and proposal[1:] == ([5, 0], [11, 0]) and graphs.field_reuses == 0
    for i in range(3):  # steady: the device holds what the host asks for
        anchors, tokens = host_next(rows)
        rows, proposal, uploads = run()
        assert uploads == ["late"] and graphs.field_reuses == i + 1
        assert proposal[1][0] == anchors[0] and proposal[2][0] == tokens[0]
        assert proposal[1][1] == 0 and proposal[2][1] == 0  # the padding request kept its fields
    anchors, tokens = host_next(rows)
    tokens = [tokens[0] + 1]  # the host's token differs (say a stop rule rewrote it): full upload
    rows, proposal, uploads = run()
    assert uploads == ["early", "late"] and proposal[2][0] == tokens[0] and graphs.field_reuses == 3
    anchors, tokens = host_next(rows)
    step.replay()  # a diagnostic replays the step: the device's fields moved on without the host
    rows, proposal, uploads = run()
    assert uploads == ["early", "late"] and proposal[1][0] == anchors[0]
    anchors, tokens = host_next(rows)
    rows, proposal, uploads = run(params=[SamplingParams(temperature=0.5, seed=1)])  # other sampling
    assert uploads == ["early", "late"] and graphs.field_reuses == 3


def _ahead_graphs():
    """A split StepGraphs over a DeviceLikeStep, and ``run(ahead, epoch_step, **overrides) -> (rows, events)``
    that steps one request along as the engine would (events: uploads and the anchor each proposal read)."""
    graphs, step, log = _split_graphs(accept=[2, 0])
    params = [SamplingParams()]
    state = {"anchors": [5], "tokens": [11], "epoch": 0}

    def run(ahead=True, epoch_step=1, **overrides):
        log.clear()
        state["epoch"] += epoch_step
        args = dict(anchors=state["anchors"], slots=[0], tables=[[3]], anchor_tokens=state["tokens"], params=params,
                    epoch=state["epoch"], ahead=ahead)
        rows = graphs.run(KEY, **{**args, **overrides})
        events = [(entry[0], entry[1] if entry[0] == "upload" else entry[1][0]) for entry in log
                  if entry[0] in ("upload", "proposal")]
        state["anchors"], state["tokens"] = [state["anchors"][0] + rows[0][0] + 1], [rows[0][1 + rows[0][0]]]
        return rows, events
    return graphs, step, state, run


def test_a_step_proposing_ahead_hands_the_next_step_its_proposal_only_when_nothing_ran_between():
    """With ``ahead`` the step launches the next proposal behind its own graphs, on the advanced fields, and
    still returns its own rows; the next step skips its proposal (no early upload, no replay before the late
    upload) only with the same key, the advanced values, the next epoch and no replay of the pool between."""
    graphs, step, state, run = _ahead_graphs()
    graphs.ahead.min_hits = 0  # every case below, however many miss in a row
    rows, events = run()  # a first step: its own proposal, then the next one's on the advanced anchor
    assert rows[0] == [2, 0, 1, 2] and events == [("upload", "early"), ("proposal", 5), ("upload", "late"),
                                                ("proposal", 8)]
    rows, events = run()  # steady: the proposal ran already; only the late fields go up
    assert graphs.ahead.used == 1 and events == [("upload", "late"), ("proposal", 11)]
    assert rows[0] == [2, 100, 101, 102], "the rows read are this step's, not the proposal's behind it"
    rows, events = run(ahead=False)  # the caller expects a change: nothing is launched behind the step
    assert graphs.ahead.used == 2 and events == [("upload", "late")]
    rows, events = run()  # no proposal ahead to use: the device still holds the advanced fields
    assert graphs.ahead.used == 2 and graphs.field_reuses == 1
    assert events == [("proposal", 14), ("upload", "late"), ("proposal", 17)]
    rows, events = run(epoch_step=2)  # another runner step ran between (a prefill, say)
    assert graphs.ahead.used == 2 and graphs.field_reuses == 2 and events[0] == ("proposal", 17)
    step.replay(stop=PROPOSED)  # a diagnostic replays a graph of the pool
    rows, events = run()
    assert graphs.ahead.used == 2 and events[0] == ("proposal", 20)
    state["tokens"] = [state["tokens"][0] + 1]  # the host's token differs (a stop rule rewrote it)
    rows, events = run()
    assert graphs.ahead.used == 2 and events[:2] == [("upload", "early"), ("proposal", 23)]
    rows, events = run()  # and the step after that is steady again
    assert graphs.ahead.used == 3 and events == [("upload", "late"), ("proposal", 29)]


def test_proposals_ahead_stop_while_the_prediction_keeps_failing_and_resume_once_it_holds():
    """More than AHEAD_WINDOW - AHEAD_MIN_HITS of the last AHEAD_WINDOW predictions wrong: no proposal is
    launched ahead; the predictions are still checked, and proposals ahead resume once enough hold again."""
    graphs, step, state, run = _ahead_graphs()
    run()
    allowed = AHEAD_WINDOW - AHEAD_MIN_HITS
    for miss in range(allowed + 1):  # another runner step between each: the prediction fails
        rows, events = run(epoch_step=2)
        launched = events[-1][0] == "proposal" and events[-2] == ("upload", "late")
        assert launched == (miss < allowed), f"miss {miss + 1}: a proposal ahead {'not ' * launched}expected"
    for hit in range(AHEAD_MIN_HITS):  # steady again: checked every step, launched once enough held
        rows, events = run()
        launched = events[-1][0] == "proposal" and events[-2] == ("upload", "late")
        assert launched == (hit == AHEAD_MIN_HITS - 1), f"hit {hit + 1}: launched {launched}"
    rows, events = run()
    assert events == [("upload", "late"), ("proposal", state["anchors"][0])] and graphs.ahead.used == 1
