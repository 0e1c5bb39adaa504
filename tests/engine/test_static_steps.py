"""The CUDA-graph step path (fast/engine/graphs/graph_step.py) without the capture, on CPU: static buffers, bucket
padding (3 running requests in a bucket of 4, page tables widened to a power of two), the one-upload fill,
and the whole speculative step function (propose -> verify forward -> verify -> commit -> observe).

On CPU ``CapturedStep.replay`` runs the step function on the static fields, so everything the graphs
replay on the GPU runs here except the capture itself (conformance/gpu/test_cuda_graphs.py does that).
The tokens must be the plain eager engine's (same keyed randomness), off / MTP / DFlash, dense and
MoE: mixed greedy and sampled requests and all-greedy requests (plain decode replays the target
forward and its draw; speculative steps replay the whole step function, sampled verification included).
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.engine.graphs.graph_step import StepGraphs, TargetGraphs
from dflash2.fast.engine.graphs.step_buffers import buckets, page_bucket
from dflash2.fast.engine.scheduler import pages_for
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target

PROMPTS = [[1, 2, 3], list(range(5, 30)), [9] * 7, list(range(40, 51)), [4, 4]]
PARAMS = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=30, temperature=1.0, top_k=5, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)]


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def stack(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = write_tiny_target(root / "target", request.param, tokenizer=None)
    return target, write_tiny_draft(root / "draft", target)


def test_buckets_and_page_widths():
    assert buckets(1) == [1] and buckets(3) == [1, 2, 3] and buckets(16) == [1, 2, 4, 8, 16]
    assert page_bucket(3, 100) == 16 and page_bucket(17, 100) == 32 and page_bucket(90, 100) == 100


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
def test_the_static_step_path_gives_the_eager_tokens(stack, algorithm):
    target, draft = stack
    kwargs = dict(dtype=torch.float32, max_running_req=5, speculative_algorithm=algorithm, speculative_depth="fixed",
                  speculative_draft_model_path=draft if algorithm == "dflash" else None)  # sampled: exact at fixed k
    eager = LLM(target, **kwargs).generate(PROMPTS, PARAMS)
    llm = LLM(target, **kwargs)
    engine = llm.engine
    runner = engine.runner
    max_pages = pages_for(engine.model.max_model_len, engine.config.page_size)
    runner.graphs = TargetGraphs(runner.target, runner.pools, max_seqs=5, max_pages=max_pages)
    if algorithm != "none":
        runner.step_graphs = StepGraphs(runner.spec, max_seqs=5, max_pages=max_pages)
    eager_verify, eager_ks, ragged = runner._verify_eager, [], []

    def counted(reqs, ks, top_logprobs):
        eager_ks.append(ks)
        return eager_verify(reqs, ks, top_logprobs)
    runner._verify_eager = counted
    original_run = StepGraphs.run

    def run(self, key, **kw):  # the steps whose requests verify different k (near their max_tokens)
        if kw["ks"] is not None and len(set(kw["ks"])) > 1:
            ragged.append(kw["ks"])
        return original_run(self, key, **kw)
    StepGraphs.run = run
    try:
        static = llm.generate(PROMPTS, PARAMS)
    finally:
        StepGraphs.run = original_run
    if algorithm != "none":  # requests near their end verified fewer drafts, on the captured step
        # (a step of no drafts at all runs eagerly under a fixed depth: it is captured only for an adaptive one)
        assert ragged and all(max(ks) == 0 for ks in eager_ks), (ragged, eager_ks)
    used = runner.graphs.graphs if algorithm == "none" else runner.step_graphs.graphs
    assert used, "no step went through the static path"
    assert any(key.num_seqs == 4 for key in used)  # a bucket was padded (3 running requests -> 4)
    # sampled steps replayed too, with their summary in the key (a plain decode draws inside its replay)
    assert any(key.sampling.any_sampled for key in used)
    for a, b in zip(static, eager):
        assert a.error is None and a.token_ids == b.token_ids


@pytest.mark.parametrize("algorithm", ["mtp", "dflash"])
def test_greedy_speculative_steps_replay_the_static_step(stack, algorithm):
    target, draft = stack
    greedy = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True) for p in PARAMS]
    kwargs = dict(dtype=torch.float32, max_running_req=5, speculative_algorithm=algorithm,
                  speculative_draft_model_path=draft if algorithm == "dflash" else None)
    eager = LLM(target, **kwargs).generate(PROMPTS, greedy)
    llm = LLM(target, **kwargs)
    runner = llm.engine.runner
    max_pages = pages_for(llm.engine.model.max_model_len, llm.engine.config.page_size)
    runner.step_graphs = StepGraphs(runner.spec, max_seqs=5, max_pages=max_pages)
    static = llm.generate(PROMPTS, greedy)
    assert any(key.num_seqs == 4 for key in runner.step_graphs.graphs)  # a padded bucket replayed
    for a, b in zip(static, eager):
        assert a.error is None and a.token_ids == b.token_ids


@pytest.mark.parametrize("algorithm", ["mtp", "dflash"])
def test_steps_of_changing_depth_replay_the_static_step_with_the_eager_tokens(stack, algorithm):
    """An adaptive depth (here cycled step by step, plain k = 0 steps among them) replays a static step per depth,
    with the tokens of eager steps at the same depths (mixed greedy and sampled requests)."""
    import itertools

    target, draft = stack
    kwargs = dict(dtype=torch.float32, max_running_req=5, speculative_algorithm=algorithm, speculative_depth="adaptive",
                  speculative_draft_model_path=draft if algorithm == "dflash" else None)

    def cycling(llm):
        depths = itertools.cycle(llm.engine.depth.depths)
        llm.engine.scheduler.depth = lambda num_seqs: next(depths)
        return llm

    eager = cycling(LLM(target, **kwargs)).generate(PROMPTS, PARAMS)
    llm = cycling(LLM(target, **kwargs))
    runner = llm.engine.runner
    max_pages = pages_for(llm.engine.model.max_model_len, llm.engine.config.page_size)
    runner.step_graphs = StepGraphs(runner.spec, max_seqs=5, max_pages=max_pages)
    static = llm.generate(PROMPTS, PARAMS)
    assert {key.rows_per_seq for key in runner.step_graphs.graphs} >= {1, 2}  # k = 0 and k = 1 steps replayed
    for a, b in zip(static, eager):
        assert a.error is None and a.token_ids == b.token_ids
