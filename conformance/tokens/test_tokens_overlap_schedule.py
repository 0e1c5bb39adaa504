"""Overlap scheduling (``EngineConfig.overlap_schedule``, fast/engine/runner.py) gives the synchronous engine's
tokens: a steady speculative step launches the next one before its own tokens are read, and the host commits
step n while step n + 1 runs.

On the CPU the captured step path runs without capturing (``CapturedStep`` calls the step function), so a step
"launched ahead" runs at once, in the same order the GPU's stream would run it: everything but the concurrency
is exercised here (conformance/gpu/test_cuda_graphs.py runs the captured steps). Checked, for DFlash and MTP on
the dense and MoE tiny targets:

- mixed greedy and sampled requests at a fixed depth: the tokens of ``--disable-overlap-schedule`` exactly, with
  steps launched ahead (and none without overlap);
- a request aborted while a step that holds it is in flight: its rows are dropped, the others keep the tokens
  they have alone, and every page, slot and ring slot comes back;
- the step the engine collects may launch the next one: a chain of steps launched ahead, every one collected.
"""

from __future__ import annotations

import pytest

from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.engine.engine import Engine
from dflash2.fast.engine.graphs.graph_step import StepGraphs, TargetGraphs
from dflash2.fast.engine.scheduler import pages_for
from dflash2.reference.request.sampling_params import SamplingParams

PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 3, 3], list(range(20, 41)), [11, 4, 8, 15], [6] * 9]
PARAMS = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=33, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=1.0, top_k=7, seed=12, ignore_eos=True),
          SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.7, seed=13, ignore_eos=True)]
CASES = [(preset, algorithm) for preset in ("tiny-dense", "tiny-moe") for algorithm in ("dflash", "mtp")]


def static_engine(tiny, preset: str, algorithm: str, *, overlap: bool, max_running_req: int = 5) -> Engine:
    """An engine on the captured step path (CPU: replayed without capture), at a fixed depth."""
    t = tiny(preset)
    engine = Engine(EngineConfig(model_path=str(t.target), speculative_algorithm=algorithm, device="cpu",
                                 dtype="float32", max_running_req=max_running_req, cpu_cache_bytes=16 << 20,
                                 speculative_draft_model_path=str(t.draft) if algorithm == "dflash" else None,
                                 speculative_depth="fixed", overlap_schedule=overlap))
    runner = engine.runner
    max_pages = pages_for(engine.max_model_len, engine.config.page_size)
    runner.graphs = TargetGraphs(runner.target, runner.pools, max_seqs=max_running_req, max_pages=max_pages)
    runner.step_graphs = StepGraphs(runner.spec, max_seqs=max_running_req, max_pages=max_pages)
    return engine


@pytest.mark.parametrize("preset, algorithm", CASES)
def test_overlapped_steps_give_the_synchronous_tokens(tiny, preset, algorithm):
    sync = static_engine(tiny, preset, algorithm, overlap=False)
    expected = sync.generate(PROMPTS, PARAMS)
    assert sync.runner.step_graphs.launched_ahead == 0
    engine = static_engine(tiny, preset, algorithm, overlap=True)
    got = engine.generate(PROMPTS, PARAMS)
    assert engine.runner.step_graphs.launched_ahead > 0, "no step was launched ahead"
    assert engine.runner.in_flight is None and engine.pool_usage().idle
    for a, b in zip(got, expected):
        assert a.error is None and a.token_ids == b.token_ids
        assert a.verify_steps == b.verify_steps and a.num_emitted == b.num_emitted


@pytest.mark.parametrize("preset, algorithm", CASES)
def test_a_request_aborted_while_its_step_is_in_flight(tiny, preset, algorithm):
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    alone = [static_engine(tiny, preset, algorithm, overlap=False, max_running_req=1).generate([p], [greedy])[0]
             for p in PROMPTS[:3]]
    engine = static_engine(tiny, preset, algorithm, overlap=True)
    rids = [engine.add_request(p, greedy) for p in PROMPTS[:3]]
    tokens = {rid: [] for rid in rids}
    chain = 0
    while engine.runner.in_flight is None or chain < 2:  # two steps launched ahead in a row: a chain
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        chain = chain + 1 if engine.runner.in_flight is not None else 0
        assert engine.has_unfinished, "the requests ended before a step was launched ahead"
    victim = rids[1]
    assert any(req.rid == victim for req in engine.runner.in_flight.reqs)
    ended = engine.abort(victim)
    assert ended.finished and ended.finish_reason == "abort"
    while engine.has_unfinished or engine.runner.in_flight is not None:
        for delta in engine.step():
            assert delta.request_id != victim, "the aborted request's rows were committed"
            tokens[delta.request_id] += delta.token_ids
    for rid, out in zip(rids, alone):
        if rid != victim:
            assert tokens[rid] == out.token_ids
    assert engine.pool_usage().idle
