"""The engine hands the depth policy no step time for a step that captured a CUDA graph (fast/speculative/depth.py):
on the CPU the captured step path runs without capturing but keys its steps the same way, so each key's first
step is the one that would capture."""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.engine.graphs.graph_step import StepGraphs, TargetGraphs
from dflash2.fast.engine.scheduler import pages_for
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth-captures")
    target = write_tiny_target(root / "target", "tiny-dense", tokenizer=None)
    return target, write_tiny_draft(root / "draft", target)


def test_steps_that_capture_report_no_time(pair):
    target, draft = pair
    llm = LLM(target, dtype=torch.float32, max_running_req=4, speculative_algorithm="dflash",
              speculative_draft_model_path=draft, speculative_depth="adaptive")
    engine, runner = llm.engine, llm.engine.runner
    max_pages = pages_for(engine.max_model_len, engine.config.page_size)
    runner.graphs = TargetGraphs(runner.target, runner.pools, max_seqs=4, max_pages=max_pages)
    runner.step_graphs = StepGraphs(runner.spec, max_seqs=4, max_pages=max_pages)
    engine.runner.graph_plain_steps = True
    seen: list[float | None] = []
    record = engine.depth.record
    engine.depth.record = lambda num_seqs, k, seconds, ks, acc: (seen.append(seconds),
                                                                   record(num_seqs, k, seconds, ks, acc))
    prompts = [[3, 1, 4, 1, 5], list(range(10, 60)), [9] * 12, [2, 7]]
    llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    keys = len(runner.graphs.graphs) + len(runner.step_graphs.graphs)
    assert keys >= 2 and seen.count(None) == keys
    assert sum(s is not None for s in seen) > keys  # the other steps were timed
