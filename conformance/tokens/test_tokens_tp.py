"""The engine at tensor_parallel_size 2 and 4 (fast/engine/tp/) against tp=1, with speculation and the prefix cache.

The engine process is rank 0 (scheduler, the unsharded proposer, sampling, verify); the other ranks are spawned
and mirror its forwards, commits and snapshot copies over gloo. Both sides run fp32: only the order of the sums
inside each row-parallel projection differs, so, on these tiny targets:

- greedy tokens (EXACT): plain decoding, MTP and DFlash on the dense and MoE targets at tp=2, DFlash on a variant
  with every head count divisible by 4 at tp=4, the same tokens as tp=1, and the same tokens per verify step;
- accepted drafts committed on every rank: with an oracle proposer that peeks at the target (``oracle_drafts.py``:
  accepts, corrects and bonuses at many places; the tiny random drafts accept nothing), tp=2 gives tp=1's tokens
  and tokens per step, which a worker keeping the wrong rows of a verify would break;
- the prefix cache under tp=2: a hit on a snapshot made during prefill and a chat's second turn resumed on the
  first turn's finish snapshot give a cold tp=1 engine's tokens (the workers' snapshot slots and copied pages
  mirror rank 0's, or the resumed GDN state would be wrong on their heads);
- the captured-step path (``TargetGraphs``: static buffers, padded buckets; on the CPU replayed without a capture)
  mirrored on the workers (``TPWorkers.graph_run``): plain decoding and DFlash at tp=2 give tp=1's tokens on the
  same path, sampled requests included;
- DISTRIBUTION: the first three tokens of DFlash requests sampled through the tp=2 engine (T = 1, top_k = 3,
  one seed per request) follow the target's exact law p(t1) p(t2 | t1) p(t3 | t1, t2), enumerated with the
  reference target, every one of the 27 cells within 5 standard errors.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash2.fast.engine.graphs.graph_step import TargetGraphs
from dflash2.fast.engine.scheduler import pages_for
from dflash2.fast.llm import LLM
from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.model.target import ReferenceTarget
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.law import exact_sequence_law, worst_deviation
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import PRESETS, write_tiny_target
from oracle_drafts import PeekingDrafter

# heads divisible by 4 (H 8, Hkv 4, Hk 4, Hv 8), as conformance/layers/test_tp_target.py's tp=4 variants
WIDE_HEADS = dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
KW = dict(dtype=torch.float32, device="cpu", max_running_req=2, max_num_batched_tokens=16, page_size=4,
          cpu_cache_bytes=8 << 20)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [(7 * i + 3) % 200 for i in range(37)]]  # one crosses chunks and pages


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(preset: str):
        if preset not in cache:
            root = tmp_path_factory.mktemp(preset)
            spec = replace(PRESETS["tiny-dense"], **WIDE_HEADS) if preset == "tiny-dense-wide" else preset
            target = write_tiny_target(root / "target", spec, tokenizer=None)
            cache[preset] = (target, write_tiny_draft(root / "draft", target, seed=3))
        return cache[preset]

    return get


def llm(checkpoints, preset: str, algorithm: str, tp: int = 1, **kw) -> LLM:
    target, draft = checkpoints(preset)
    return LLM(str(target), tensor_parallel_size=tp, speculative_algorithm=algorithm,
               speculative_draft_model_path=str(draft) if algorithm == "dflash" else None, **dict(KW, **kw))


def generate(engine: LLM, prompts, params: SamplingParams):
    outs = engine.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CASES = [("tiny-dense", "none", 2), ("tiny-dense", "mtp", 2), ("tiny-dense", "dflash", 2), ("tiny-moe", "mtp", 2),
         ("tiny-moe", "dflash", 2), ("tiny-dense-wide", "dflash", 4)]


@pytest.mark.parametrize("preset,algorithm,tp", CASES)
def test_greedy_tokens_equal_tp1(checkpoints, preset, algorithm, tp):
    expected = generate(llm(checkpoints, preset, algorithm), PROMPTS, GREEDY)
    engine = llm(checkpoints, preset, algorithm, tp)
    try:
        assert len(engine.engine.workers.processes) == tp - 1
        got = generate(engine, PROMPTS, GREEDY)
    finally:
        engine.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    # the same steps (the tiny random drafts accept almost nothing: test_accepted_drafts_are_committed_on_every_rank
    # checks the commits of accepted rows)
    assert [(o.verify_steps, o.num_emitted) for o in got] == [(o.verify_steps, o.num_emitted) for o in expected]


def test_accepted_drafts_are_committed_on_every_rank(checkpoints):
    oracle = ReferenceTarget(*load_target(checkpoints("tiny-dense")[0]))
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True)]

    def run(tp: int):
        engine = llm(checkpoints, "tiny-dense", "mtp", tp, speculative_depth="fixed", prefix_caching=False)
        engine.engine.runner.spec.proposer = PeekingDrafter(oracle)  # rank 0's proposer, as the MTP head is
        try:
            return generate(engine, PROMPTS, params)
        finally:
            engine.close()

    expected, got = run(1), run(2)
    assert sum(o.num_emitted for o in got) >= 2 * sum(o.verify_steps for o in got), "the oracle's drafts accept"
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [(o.verify_steps, o.num_emitted) for o in got] == [(o.verify_steps, o.num_emitted) for o in expected]


def chat(engine: LLM, first: list[int], second: list[int]):
    """Three requests on one engine: ``first``; ``second``, sharing a prefix of it; the next turn of the first."""
    turn1 = generate(engine, [first], GREEDY)[0]
    hit = generate(engine, [second], GREEDY)[0]
    turn2 = generate(engine, [first + turn1.token_ids + [11, 12, 13]], GREEDY)[0]
    return turn1, hit, turn2


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
def test_prefix_cache_under_tp(checkpoints, algorithm):
    first = [(7 * i + 3) % 200 + 1 for i in range(40)]
    second = first[:35] + [9, 8, 7, 6, 5]  # shares 35 tokens: resumes at the 32-token prefill snapshot
    kw = dict(snapshot_interval=16, page_size=16, max_num_batched_tokens=16, speculative_depth="fixed")
    expected = chat(llm(checkpoints, "tiny-dense", algorithm, **kw), first, second)
    engine = llm(checkpoints, "tiny-dense", algorithm, 2, **kw)
    try:
        assert engine.config.prefix_caching
        got = chat(engine, first, second)
    finally:
        engine.close()
    assert got[1].cached_tokens == 32
    # the same hits as tp=1 (a finish snapshot where tp=1 takes one) and the same tokens as tp=1, which equal a
    # cold engine's (conformance/tokens/test_tokens_prefix_cache.py)
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in expected]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    if algorithm != "dflash":  # these finish exactly at their frontier: the second turn resumes after the first
        assert got[2].cached_tokens >= len(first) + GREEDY.max_tokens - 1


def on_graph_path(engine: LLM) -> LLM:
    """Rank 0's decode and verify forwards through TargetGraphs (as on CUDA), mirrored on the workers."""
    e = engine.engine
    max_pages = pages_for(e.max_model_len, e.config.page_size)
    e.runner.graphs = TargetGraphs(e.runner.target, e.runner.pools, max_seqs=e.config.max_running_req,
                                   max_pages=max_pages)
    if e.workers is not None:
        e.runner.graphs.before_run = e.workers.graph_run
    return engine


@pytest.mark.parametrize("algorithm", ["none", "dflash"])
def test_graph_path_mirrored_on_the_workers(checkpoints, algorithm):
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, top_k=7, seed=3, ignore_eos=True)]
    kw = dict(speculative_depth="fixed") if algorithm != "none" else {}
    expected = generate(on_graph_path(llm(checkpoints, "tiny-dense", algorithm, **kw)), PROMPTS, params)
    engine = on_graph_path(llm(checkpoints, "tiny-dense", algorithm, 2, **kw))
    try:
        got = generate(engine, PROMPTS, params)
        assert engine.engine.runner.graphs.graphs, "no step took the graph path"
    finally:
        engine.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [(o.verify_steps, o.num_emitted) for o in got] == [(o.verify_steps, o.num_emitted) for o in expected]


LAW_PROMPT = [7, 21, 7, 21, 7, 3]
LAW_TOKENS, LAW_RUNS = 3, 320


def law_params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=LAW_TOKENS, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)


def test_sampled_dflash_law_through_tp2(checkpoints):
    target_path, _ = checkpoints("tiny-dense")
    exact = exact_sequence_law(ReferenceTarget(*load_target(target_path)), LAW_PROMPT, LAW_TOKENS, law_params(0))
    engine = llm(checkpoints, "tiny-dense", "dflash", 2, max_running_req=16, speculative_num_steps=2,
                 speculative_depth="fixed", prefix_caching=False, cpu_cache_bytes=64 << 20)
    try:
        outs = generate(engine, [LAW_PROMPT] * LAW_RUNS, [law_params(seed) for seed in range(1, LAW_RUNS + 1)])
    finally:
        engine.close()
    assert sum(o.verify_steps for o in outs) > 0  # the tokens went through verify steps, not only the prefill
    worst = worst_deviation(exact, [o.token_ids for o in outs])  # inf: a sequence the target cannot produce
    assert worst < 5.0, f"a cell of the sampled law is {worst:.1f} standard errors from the target's"
