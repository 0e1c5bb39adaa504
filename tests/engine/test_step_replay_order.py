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

from dflash2.fast.engine.graphs import (PROPOSED, REQUEST_FLOAT_FIELDS, REQUEST_INT_FIELDS, GraphKey,
                                        StepGraphs)
from dflash2.reference.request.sampling_params import SamplingParams

KEY = GraphKey(num_seqs=2, rows_per_seq=3, pages=2, is_verify=True)


class RecordingStep:
    """A captured step's stand-in: two graphs, cut at PROPOSED; records uploads and replays with
    the device fields each replay saw."""

    def __init__(self, inputs, log):
        self.inputs, self.log, self.marks = inputs, log, {PROPOSED: 1}
        upload = inputs.upload

        def recording_upload(part="all"):
            upload(part)
            log.append(("upload", part))
        inputs.upload = recording_upload

    def replay(self, start=None, stop=None):
        seen = {name: self.inputs.views[name].clone() for name in ("anchors", "block_tables")}
        self.log.append(("replay", start, stop, seen))
        return torch.zeros(KEY.num_seqs, 1 + KEY.rows_per_seq, dtype=torch.long)


def run_once(split_after_propose: bool):
    graphs = StepGraphs(SimpleNamespace(device=torch.device("cpu"), page_size=8), step_fn=None,
                        max_seqs=4, max_pages=2, split_after_propose=split_after_propose)
    early = (*REQUEST_INT_FIELDS, *REQUEST_FLOAT_FIELDS, "state_slots") if split_after_propose else ()
    inputs = graphs._padding(KEY, {name: KEY.num_seqs for name in REQUEST_INT_FIELDS},
                             {name: KEY.num_seqs for name in REQUEST_FLOAT_FIELDS}, early=early)
    log: list = []
    graphs.graphs[KEY] = RecordingStep(inputs, log)
    graphs.run(KEY, anchors=[5, 9], slots=[0, 1], tables=[[3], [4, 6]], anchor_tokens=[11, 12],
               params=[SamplingParams(temperature=1.0, seed=1), SamplingParams()], keep=-1)
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
