"""fast/model/side_stream.py and its two supports: a capture's cut joins an open fork first
(fast/model/capture.join_before_cut), and the side stream's kernels draw ticket counters from their own
lane (fast/kernels/common/tickets.lane); a captured DFlash step observes from the last tap on (runner)."""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.speculative import step as step_module
from dflash2.fast.model.side_stream import SIDE_LANE, SideStream
from dflash2.fast.kernels.common import tickets
from dflash2.fast.model import capture


def test_on_the_cpu_a_fork_runs_at_once_and_the_join_does_nothing():
    side, ran = SideStream(torch.device("cpu")), []
    side.fork(lambda: ran.append("work"))
    assert ran == ["work"] and not side.pending
    side.join()
    side.fork(lambda: ran.append("again"))  # nothing pending on the CPU: a second fork is fine
    assert ran == ["work", "again"]


def test_a_cut_joins_the_open_forks_first_and_only_inside_a_capture():
    events = []
    capture.join_before_cut(lambda: events.append("stray join"))  # outside a capture: not registered
    with capture.cutting(lambda mark: events.append(f"cut {mark}")):
        capture.join_before_cut(lambda: events.append("join a"))
        capture.join_before_cut(lambda: events.append("join b"))
        capture.graph_cut("one")
        capture.graph_cut("two")  # the joins ran once, at the first cut
        capture.join_before_cut(lambda: events.append("join c"))  # never cut after: its owner joins
    capture.graph_cut("outside")
    assert events == ["join b", "join a", "cut one", "cut two"]
    assert capture._joins == [] and capture._cut is None


def test_nested_cutting_keeps_the_outer_joins():
    events = []
    with capture.cutting(lambda mark: events.append("outer cut")):
        capture.join_before_cut(lambda: events.append("outer join"))
        with capture.cutting(lambda mark: events.append("inner cut")):
            capture.graph_cut()
        capture.graph_cut()
    assert events == ["inner cut", "outer join", "outer cut"]


def test_each_lane_has_its_own_zeroed_counters():
    device = torch.device("cpu")
    main = tickets.ticket_counters(device, 4)
    with tickets.lane(SIDE_LANE):
        side = tickets.ticket_counters(device, 4)
        assert tickets.ticket_counters(device, 4) is side
    assert tickets.ticket_counters(device, 4) is main
    assert side.data_ptr() != main.data_ptr() and not side.any() and not main.any()
    with pytest.raises(ValueError, match="MAX_COUNTERS"):
        tickets.ticket_counters(device, tickets.MAX_COUNTERS + 1)


def test_the_captured_dflash_step_observes_before_the_verify_and_the_commit(tmp_path, monkeypatch):
    """The static step (the CPU runs its function on the static fields) calls ``observe_taps`` from inside
    the target forward, before the verify and the GDN commit; the eager verify step observes last. Both
    give the same tokens (tests/engine/test_static_steps.py holds the static path to the eager one)."""
    from dflash2.fast.engine.graphs.graph_step import StepGraphs, TargetGraphs
    from dflash2.fast.engine.scheduler import pages_for
    from dflash2.fast.llm import LLM, SamplingParams
    from dflash2.reference.tiny.draft import write_tiny_draft
    from dflash2.reference.tiny.target import write_tiny_target

    target = write_tiny_target(tmp_path / "target", "tiny-dense", tokenizer=None)
    draft = write_tiny_draft(tmp_path / "draft", target)
    events = []
    commit = step_module.commit_verify
    monkeypatch.setattr(step_module, "commit_verify",
                        lambda *a, **kw: events.append("commit_verify") or commit(*a, **kw))
    tokens = {}
    for static in (True, False):
        llm = LLM(target, dtype=torch.float32, speculative_algorithm="dflash", speculative_num_steps=3,
                  speculative_draft_model_path=draft)
        engine = llm.engine
        runner = engine.runner
        if static:
            max_pages = pages_for(engine.model.max_model_len, engine.config.page_size)
            runner.graphs = TargetGraphs(runner.target, runner.pools, max_seqs=1, max_pages=max_pages)
            runner.step_graphs = StepGraphs(runner.spec, max_seqs=1, max_pages=max_pages)
        spec = runner.spec
        verify, observe = spec.verifier, spec.proposer.observe_taps
        spec.verifier = lambda *a, _fn=verify: events.append("verify_ragged") or _fn(*a)
        spec.proposer.observe_taps = lambda *a, _fn=observe: events.append("observe") or _fn(*a)
        events.clear()
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        tokens[static] = out[0].token_ids
        steps = {tuple(events[i:i + 3]) for i in range(len(events) - 2)}
        if static:
            assert runner.step_graphs.graphs and ("observe", "verify_ragged", "commit_verify") in steps, events
        else:
            assert ("verify_ragged", "commit_verify", "observe") in steps, events
    assert tokens[True] == tokens[False]
