"""The startup warm-up (fast/engine/warmup.py): every batch bucket is stepped, greedy and sampled, and
the engine is idle afterwards (every page, slot and ring back)."""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.engine.graphs.graph_step import StepGraphs, TargetGraphs
from dflash2.fast.engine.graphs.step_buffers import buckets
from dflash2.fast.engine.scheduler import pages_for
from dflash2.fast.engine.warmup import warm_up
from dflash2.fast.llm import LLM
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup")
    target = write_tiny_target(root / "target", "tiny-dense", tokenizer=None)
    return target, write_tiny_draft(root / "draft", target)


@pytest.mark.parametrize("algorithm", ["none", "dflash"])
def test_warm_up_steps_every_bucket_and_leaves_the_engine_idle(stack, algorithm):
    target, draft = stack
    llm = LLM(target, dtype=torch.float32, max_running_req=5, speculative_algorithm=algorithm,
              speculative_draft_model_path=draft if algorithm == "dflash" else None, speculative_depth="fixed")
    engine, runner = llm.engine, llm.engine.runner
    max_pages = pages_for(engine.max_model_len, engine.config.page_size)
    # the CPU runs the static step path without capturing (CapturedStep), so the keys it steps are visible
    runner.graphs = TargetGraphs(runner.target, runner.pools, max_seqs=5, max_pages=max_pages)
    if algorithm != "none":
        runner.step_graphs = StepGraphs(runner.spec, max_seqs=5, max_pages=max_pages)
    restores = []
    load = engine.model.snapshots.load
    engine.model.snapshots.load = lambda *args: (restores.append(len(args[0])), load(*args))
    report = warm_up(engine)
    # two waves, a prompt filling a chunk alone, then a prefix-cache hit for each of the wave's requests
    assert report["requests"] == 10 + 1 + 5 and report["seconds"] > 0
    assert sum(restores) == 5  # the restore path ran (and compiled) for each
    keys = runner.graphs.graphs if algorithm == "none" else runner.step_graphs.graphs
    assert {key.num_seqs for key in keys} == set(buckets(5))
    if algorithm != "none":
        assert {key.sampling.any_sampled for key in keys} == {False, True}
    assert engine.prefix_cache.stats.queries == 0  # serving counts its own lookups
    assert engine.pool_usage().idle and engine.pool_usage().snapshots == 0  # and starts with an empty cache


def test_an_adaptive_depth_warms_up_every_depth_and_keeps_their_costs(stack):
    """Each depth of the policy steps every batch bucket before the first request; the policy keeps what the
    steps cost (the shallow depths run several uniform steps a bucket: priced before serving) and forgets the
    warm-up prompts' acceptance, and chooses the depths again afterwards."""
    target, draft = stack
    llm = LLM(target, dtype=torch.float32, max_running_req=5, speculative_algorithm="dflash",
              speculative_draft_model_path=draft, speculative_depth="adaptive")
    engine, runner = llm.engine, llm.engine.runner
    max_pages = pages_for(engine.max_model_len, engine.config.page_size)
    runner.graphs = TargetGraphs(runner.target, runner.pools, max_seqs=5, max_pages=max_pages)
    runner.step_graphs = StepGraphs(runner.spec, max_seqs=5, max_pages=max_pages)
    policy = engine.depth
    report = warm_up(engine)
    assert report["requests"] == 5 * (2 + len(policy.depths) - 1) + 1 + 5
    stepped = {(key.rows_per_seq - 1, key.num_seqs) for key in runner.step_graphs.graphs}
    assert {(d, b) for d in policy.depths for b in (1, 2, 4)} <= stepped
    assert all(policy.costs[(b, d)].seconds is not None for d in policy.depths[:-1] for b in (1, 2, 4))  # priced
    assert policy.alpha.tolist() == [policy.prior_alpha] * policy.k
    assert engine.scheduler.depth == policy.choose and engine.pool_usage().idle
