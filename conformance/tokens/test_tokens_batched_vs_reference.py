"""The fast engine, continuously batching requests of different lengths and sampling parameters, emits
each request's reference tokens (TOKEN_STREAM), with speculative decoding off, MTP and DFlash 2.

Five requests share an engine of two running slots and a 16-token prefill budget, so requests wait
and are admitted as others finish, a 37-token prompt is prefilled in three chunks beside other
prompts, and greedy, top-k = 1 and sampled requests (temperature, top-k, top-p, seeds up to 2^64)
share every decode or verify step. Each is compared with the same request alone through
``ReferenceRunner`` (plain ``generate`` or ``speculative_generate``).
"""

from __future__ import annotations

import pytest

from dflash2.fast.engine.scheduler import DecodePlan, PrefillPlan, Scheduler
from dflash2.fast.llm import LLM
from dflash2.reference.request.sampling_params import SamplingParams
from tokens_harness import Case, assert_token_stream

CASES = [
    Case([5, 17, 42, 99, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
    Case(list(range(1, 38)), SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=20, seed=3)),
    Case([7], SamplingParams(max_tokens=10, temperature=1.2, seed=11, ignore_eos=True)),
    Case(list(range(200, 221)), SamplingParams(max_tokens=14, temperature=0.7, top_k=1, ignore_eos=True)),
    Case([9, 8, 7, 6, 5, 4, 3, 2, 1], SamplingParams(max_tokens=7, temperature=0.6, top_k=5, seed=2**63 + 5,
                                                     ignore_eos=True)),
]
ENGINE = dict(dtype="float32", max_running_req=2, max_num_batched_tokens=16, page_size=4, cpu_cache_bytes=4 << 20)


@pytest.fixture
def plans(monkeypatch) -> list:
    """Every plan the scheduler makes, with the queue lengths at that moment."""
    seen: list = []
    original = Scheduler.schedule

    def recording(self):
        plan = original(self)
        seen.append((plan, len(self.running), len(self.waiting)))
        return plan

    monkeypatch.setattr(Scheduler, "schedule", recording)
    return seen


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_batched_requests_match_the_reference_alone(tiny, reference_runner, plans, preset, algorithm):
    t = tiny(preset)
    llm = LLM(t.target, speculative_algorithm=algorithm,  # a fixed depth: sampled tokens compared exactly
              speculative_draft_model_path=t.draft if algorithm == "dflash" else None, speculative_depth="fixed",
              **ENGINE)
    outputs = llm.generate([c.prompt for c in CASES], [c.params for c in CASES])
    runner = reference_runner(preset, algorithm)
    assert llm.k == runner.k
    for i, (case, out) in enumerate(zip(CASES, outputs)):
        ref = runner.generate(case.prompt, case.params)
        assert out.error is None
        assert_token_stream(out.token_ids, ref.token_ids, runner, case.prompt, f"{preset} {algorithm} request {i}")
        if out.token_ids == ref.token_ids:
            assert (out.finish_reason, out.text) == (ref.finish_reason, ref.text)
            if algorithm != "none":
                assert out.verify_steps == len(ref.steps) and out.tokens_per_step == ref.tokens_per_step
    # continuous batching happened: at most two running, others waiting, the long prompt chunked
    assert max(running for _, running, _ in plans) == 2
    assert any(isinstance(p, DecodePlan) and waiting for p, _, waiting in plans)
    chunks = [c for p, _, _ in plans if isinstance(p, PrefillPlan) for c in p.chunks]
    long_prompt = [c.length for c in chunks if c.req.prompt_len == 37]
    assert sum(long_prompt) == 37 and len(long_prompt) >= 3
    prefills = [p for p, _, _ in plans if isinstance(p, PrefillPlan)]
    assert all(sum(c.length for c in p.chunks) <= 16 for p in prefills)
    assert any(len(p.chunks) > 1 for p in prefills)  # prompts of two requests in one step
