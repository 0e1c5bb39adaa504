"""Every path of a batched verify step, token for token against the reference loop: drafts from a
proposer that peeks at the target (``oracle_drafts.py``) are accepted, rejected and corrected, and
earn bonus tokens, in greedy and sampled requests batched together, with k shrinking per request
near its max_tokens (down to k = 0), GDN rollback by ``commit_verify`` and continuous batching.

The engine runs the real fast target and caches; only its proposer is replaced. The reference is
``speculative_generate`` with the same oracle, each request alone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.engine.engine import Engine
from dflash2.fast.engine.startup import load_model
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.loop import speculative_generate
from oracle_drafts import PeekingDrafter, PeekingProposer
from tokens_harness import Case, assert_token_stream

K = 4
CASES = [
    Case([5, 17, 42, 99, 3], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)),
    Case(list(range(1, 24)), SamplingParams(max_tokens=11, temperature=0.9, top_p=0.95, seed=8, ignore_eos=True)),
    Case([7, 7], SamplingParams(max_tokens=9, temperature=1.0, seed=2, ignore_eos=True)),
    Case(list(range(300, 312)), SamplingParams(max_tokens=13, temperature=0.7, top_k=10, seed=4, ignore_eos=True)),
    Case([44, 1, 9], SamplingParams(max_tokens=6, temperature=0.5, top_k=1, ignore_eos=True)),
]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_peeking_drafts_match_the_reference_loop(tiny, reference_runner, preset):
    t = tiny(preset)
    config = EngineConfig(model_path=str(t.target), dtype="float32", speculative_algorithm="mtp",
                          speculative_num_steps=K, max_running_req=3, max_num_batched_tokens=12, page_size=4,
                          cpu_cache_bytes=2 << 20, speculative_depth="fixed")
    runner = reference_runner(preset)
    model = replace(load_model(config), proposer=PeekingDrafter(runner.target))
    engine = Engine(config, trace=True, model=model)
    outputs = engine.generate([c.prompt for c in CASES], [c.params for c in CASES])
    accepted = 0
    for i, (case, out) in enumerate(zip(CASES, outputs)):
        ref = speculative_generate(runner.target, PeekingProposer(runner.target), case.prompt, case.params, K,
                                   runner.stop_token_ids, runner.decode)
        assert_token_stream(out.token_ids, ref.token_ids, runner, case.prompt, f"{preset} request {i}")
        if out.token_ids == ref.token_ids:
            assert [s.to_json() for s in out.steps] == [s.to_json() for s in ref.steps]
        accepted += sum(s.num_accepted for s in out.steps)
    steps = [s for out in outputs for s in out.steps]
    assert accepted >= 10, "the oracle should get drafts accepted"
    assert any(0 < s.num_accepted < len(s.draft_tokens) for s in steps), "a correction after accepted drafts"
    assert any(s.num_accepted == len(s.draft_tokens) > 0 for s in steps), "a bonus after all drafts accepted"
    assert any(len(s.draft_tokens) == 0 for s in steps), "a k = 0 step at a request's end"
