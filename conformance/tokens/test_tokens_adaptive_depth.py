"""The adaptive speculative depth (fast/speculative/depth.py) against the reference: steps whose k changes from step
to step, down to plain decoding (k = 0), keep greedy outputs equal to the reference's plain greedy decoding and
sampled outputs on the target's law.

The depth here is not left to the machine's timings (which would make the test depend on the CI runner): the
scheduler's depth callback is replaced by a cycle over the policy's depths, the hardest case for the step path
(every step a different k, the proposer's state carried across them). The policy's own choices are tested against
simulated machines in tests/speculative/depth/.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.engine.engine import Engine
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.sampling import target_probs

from tokens_harness import assert_token_stream

PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 3, 3], [11, 4, 8, 15, 16, 23, 42, 8]]


def cycling_engine(tiny, algorithm: str, **kw) -> tuple[Engine, list[list[int]]]:
    """An adaptive-depth engine whose steps cycle over its depths; also returns each verify step's ks."""
    t = tiny("tiny-dense")
    engine = Engine(EngineConfig(model_path=str(t.target), speculative_algorithm=algorithm, device="cpu",
                                 speculative_draft_model_path=str(t.draft) if algorithm == "dflash" else None,
                                 speculative_num_steps=7 if algorithm == "dflash" else 3,
                                 speculative_depth="adaptive", **kw))
    assert engine.depth.adaptive and 0 in engine.depth.depths
    depths = itertools.cycle(engine.depth.depths)
    engine.scheduler.depth = lambda num_seqs: next(depths)
    seen: list[list[int]] = []
    verify = engine.runner.verify
    engine.runner.verify = lambda plan, **kw2: seen.append(list(plan.ks)) or verify(plan, **kw2)
    return engine, seen


@pytest.mark.parametrize("algorithm", ["dflash", "mtp"])
def test_greedy_outputs_at_changing_depths_equal_plain_greedy(tiny, reference_runner, algorithm):
    engine, seen = cycling_engine(tiny, algorithm, max_running_req=3)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS, [greedy] * len(PROMPTS))
    runner = reference_runner("tiny-dense")
    for prompt, out in zip(PROMPTS, outs):
        assert_token_stream(out.token_ids, runner.generate(prompt, greedy).token_ids, runner, prompt,
                            f"{algorithm} adaptive")
    depths = {max(ks) for ks in seen}
    assert 0 in depths and len(depths) >= 3, depths  # plain steps and several draft depths really ran
    assert engine.pool_usage().idle


NUM_TOKENS, RUNS = 3, 300
LAW_PROMPT = [7, 21, 7, 21, 7, 3]


def law_params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)


def test_sampled_outputs_at_changing_depths_follow_the_target_law(tiny, reference_runner):
    """The joint law of the first three tokens (27 cells, top_k = 3) against the reference target's exact law,
    every cell within 5 standard errors, over 300 seeds through the cycling engine (DFlash, q != p)."""
    target = reference_runner("tiny-dense").target
    law = {(): 1.0}
    for _ in range(NUM_TOKENS):
        grown = {}
        for prefix, mass in law.items():
            p = target_probs(target.forward(torch.tensor(LAW_PROMPT + list(prefix))).logits[-1], law_params(0))
            grown.update({prefix + (t,): mass * float(p[t]) for t in torch.nonzero(p).flatten().tolist()})
        law = grown
    engine, seen = cycling_engine(tiny, "dflash", max_running_req=8)
    outs = engine.generate([LAW_PROMPT] * RUNS, [law_params(seed) for seed in range(RUNS)])
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert set(counts) <= set(law), "a sequence the target cannot produce"
    worst = max(abs(counts.get(cell, 0) / RUNS - p) / math.sqrt(p * (1 - p) / RUNS) for cell, p in law.items())
    assert worst < 5.0, worst
    assert {max(ks) for ks in seen} >= {0, 1}  # the verifies ran with and without drafts
