"""The engine's incremental API (``add_request`` / ``step`` / ``abort`` / ``pool_usage``), which a server
drives: the same tokens as ``generate``, aborts that free exactly what a finish frees, accounting that
catches a leak, logprobs from the target's distribution on every step kind, and an error in one
request's commit that fails that request alone."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.fast.engine import engine as engine_module
from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.engine.engine import Engine
from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.formats.errors import RequestError
from dflash2.reference.model.target import ReferenceTarget
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.request.stopping import Stopper
from dflash2.reference.speculative.sampling import target_probs
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target

MiB = 1 << 20
PROMPTS = [[5, 17, 42, 99, 3], [7, 7, 1, 300, 2, 9, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("incremental")
    target = write_tiny_target(root / "target", "tiny-dense")
    return target, write_tiny_draft(root / "draft", target, seed=3)


def make_engine(tiny, algorithm: str = "dflash", **kw) -> Engine:
    target, draft = tiny
    args = dict(model_path=str(target), speculative_algorithm=algorithm, max_running_req=3, device="cpu",
                cpu_cache_bytes=16 * MiB, max_num_batched_tokens=6,  # fp32 on the CPU: the 1e-4 logprob bounds
                speculative_depth="fixed")  # seeded samples compared token for token (adaptive: timing decides k)
    if algorithm == "dflash":
        args["speculative_draft_model_path"] = str(draft)
    return Engine(EngineConfig(**{**args, **kw}))


def params(i: int, **kw) -> SamplingParams:
    base = dict(max_tokens=9 + i, temperature=0.0 if i % 2 == 0 else 0.8, top_p=0.9, seed=11 + i, ignore_eos=True)
    return SamplingParams(**{**base, **kw})


def run_all(engine: Engine) -> tuple[dict[int, list[int]], dict[int, object]]:
    tokens, last = {}, {}
    while engine.has_unfinished:
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if delta.finished:
                assert delta.request_id not in last, "a request finished twice"
                last[delta.request_id] = delta
    return tokens, last


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
def test_incremental_tokens_equal_generate(tiny, algorithm):
    engine = make_engine(tiny, algorithm)
    expected = engine.generate(PROMPTS, [params(i) for i in range(3)])
    idle = engine.pool_usage()
    assert idle.idle
    rids = [engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    tokens, last = run_all(engine)
    for rid, out in zip(rids, expected):
        assert tokens[rid] == out.token_ids
        assert last[rid].finish_reason == out.finish_reason == "length"
        assert last[rid].text == out.text
    assert engine.pool_usage() == idle
    if algorithm != "none":  # verify steps report their drafts and acceptances
        assert expected[0].verify_steps > 0


def test_abort_frees_what_a_finish_frees_at_every_stage(tiny):
    engine = make_engine(tiny, "dflash")
    idle = engine.pool_usage()
    assert idle.total_ring_slots == idle.total_slots == 3 and idle.free_ring_slots == 3
    reference = engine.generate([PROMPTS[2]], [params(0)])[0].token_ids
    waiting = [engine.add_request(PROMPTS[0], params(i, max_tokens=30)) for i in range(5)]  # 3 run, 2 wait
    engine.step()  # a prefill step of 6 rows: prompt 0 done, prompt 1 at 1 of 5
    engine.step()  # request 0 decodes before the next chunk
    engine.step()  # prefill: prompt 1 done, prompt 2 at 2 of 5
    assert [r.num_prefilled for r in engine.scheduler.running] == [5, 5, 2]
    usage = engine.pool_usage()
    assert usage.running == 3 and usage.waiting == 2 and usage.free_slots == 0 and usage.free_ring_slots == 0
    assert usage.free_pages < idle.free_pages or usage.reserved_pages > 0
    aborted = [engine.abort(rid) for rid in (waiting[4], waiting[2], waiting[0])]  # waiting, mid-prefill, decoding
    assert all(d.finished and d.finish_reason == "abort" and d.token_ids == [] for d in aborted)
    assert engine.abort(waiting[0]) is None  # already gone
    for _ in range(3):
        engine.step()
    assert [engine.abort(rid).finish_reason for rid in (waiting[1], waiting[3])] == ["abort", "abort"]
    assert engine.pool_usage().without_cache() == idle.without_cache()  # the finishes left snapshots
    engine.clear_prefix_cache()
    assert engine.pool_usage() == idle
    # a later request is unaffected by what the aborted ones left in their pages, slots and rings
    assert engine.generate([PROMPTS[2]], [params(0)])[0].token_ids == reference


def test_the_first_token_carries_its_queue_and_prefill_times(tiny):
    """Only a request's first delta has them, and a request that waited for a slot (3 run at once here) waited
    longer than the first one admitted."""
    engine = make_engine(tiny, "none")
    rids = [engine.add_request(PROMPTS[i % 3], params(i, max_tokens=3)) for i in range(4)]
    firsts, later = {}, []
    while engine.scheduler.has_work or engine.runner.in_flight is not None:
        for d in engine.step():
            if d.request_id in firsts:
                later.append(d)
            else:
                firsts[d.request_id] = d
    assert sorted(firsts) == sorted(rids) and later
    assert all(d.queue_s is None and d.prefill_s is None for d in later)
    assert all(d.queue_s >= 0 and d.prefill_s > 0 for d in firsts.values())
    assert firsts[rids[3]].queue_s > firsts[rids[0]].queue_s


def test_pool_usage_catches_a_planted_leak_and_double_free(tiny):
    engine = make_engine(tiny, "none")
    engine.add_request(PROMPTS[0], params(0))
    engine.step()
    running = engine.scheduler.running[0]
    leaked = running.pages.pop()  # a page neither free nor held
    with pytest.raises(RuntimeError, match="KV pages"):
        engine.pool_usage()
    running.pages.append(leaked)
    engine.scheduler.free_slots.append(running.slot)  # a slot both free and held
    with pytest.raises(RuntimeError, match="state slots"):
        engine.pool_usage()


def test_bad_requests_raise_and_touch_nothing(tiny):
    engine = make_engine(tiny, "none", max_model_len=64)
    idle = engine.pool_usage()
    for prompt, sp, match in [([], params(0), "empty prompt"), ([1, 10**6], params(0), "token ids"),
                              (list(range(1, 70)), params(0), "max_model_len"),
                              ([1, 2], {"max_tokens": 0}, "max_tokens"), ([1, 2], {"bogus": 1}, "bogus"),
                              ([1, 2], params(0, max_tokens=40000), "context")]:
        with pytest.raises(RequestError, match=match):
            engine.add_request(prompt, sp)
    for bad in (-1, 21, True, 1.0):
        with pytest.raises(RequestError, match="top_logprobs"):
            engine.add_request([1, 2], params(0), top_logprobs=bad)
    assert engine.pool_usage() == idle and not engine.has_unfinished


def test_generate_refuses_an_engine_with_requests_in_flight(tiny):
    engine = make_engine(tiny, "none")
    engine.add_request(PROMPTS[0], params(0))
    with pytest.raises(RuntimeError, match="in flight"):
        engine.generate([PROMPTS[1]], [params(1)])


def reference_logprobs(tiny, prompt: list[int], output: list[int], sp: SamplingParams) -> list[float]:
    """log p[token] at every output position, p the reference's filtered distribution (greedy: softmax)."""
    cfg, weights = load_target(tiny[0])
    logits = ReferenceTarget(cfg, weights).forward(torch.tensor(prompt + output)).logits  # [T, V]
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(output)]
    law = SamplingParams(temperature=1.0) if sp.greedy else sp
    return [math.log(float(target_probs(row, law)[t])) for row, t in zip(rows, output)]


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
def test_logprobs_are_the_targets_on_every_step_kind(tiny, algorithm):
    engine = make_engine(tiny, algorithm)
    sps = [params(0, max_tokens=12), params(1, max_tokens=12, top_k=40), params(2, max_tokens=12)]
    rids = [engine.add_request(p, sp, top_logprobs=n) for p, sp, n in zip(PROMPTS, sps, (3, 0, None))]
    tokens, logprobs = {}, {}
    while engine.has_unfinished:
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.logprobs is not None:
                assert len(d.logprobs) == len(d.token_ids)
                logprobs.setdefault(d.request_id, []).extend(d.logprobs)
    assert rids[2] not in logprobs  # it asked for none
    for rid, prompt, sp, n in zip(rids[:2], PROMPTS, sps, (3, 0)):
        got = logprobs[rid]
        assert [lp.token_id for lp in got] == tokens[rid]
        expected = reference_logprobs(tiny, prompt, tokens[rid], sp)
        assert max(abs(lp.logprob - e) for lp, e in zip(got, expected)) < 1e-4
        assert all(len(lp.top) == n for lp in got)
        for lp in got:
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))  # most likely first
            if sp.greedy:  # the committed token is the most likely one
                assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
    assert engine.pool_usage().idle


def test_a_logprob_under_top_k_is_minus_inf_off_the_support(tiny):
    engine = make_engine(tiny, "none")
    rid = engine.add_request(PROMPTS[0], params(1, max_tokens=3, top_k=2), top_logprobs=4)
    _, _ = rid, None
    seen = []
    while engine.has_unfinished:
        seen += [lp for d in engine.step() if d.logprobs for lp in d.logprobs]
    assert seen and all(lp.logprob > -math.inf for lp in seen)
    assert all([v > -math.inf for _, v in lp.top] == [True, True, False, False] for lp in seen)


def test_an_error_in_one_requests_commit_fails_it_alone(tiny, monkeypatch):
    class Failing(Stopper):
        def check(self, output, checked=0):
            if self.params.seed == 666:
                raise ValueError("planted")
            return super().check(output, checked)

    engine = make_engine(tiny, "dflash")
    expected = engine.generate(PROMPTS[:2], [params(0), params(1)])
    monkeypatch.setattr(engine_module, "Stopper", Failing)
    outs = engine.generate(PROMPTS, [params(0), params(1), params(2, seed=666)])
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in expected]
    assert outs[2].finish_reason == "error" and "planted" in outs[2].error
    assert engine.pool_usage().idle


def test_fail_running_fails_the_admitted_and_keeps_the_waiting(tiny):
    engine = make_engine(tiny, "none", max_running_req=1)
    first = engine.add_request(PROMPTS[0], params(0))
    second = engine.add_request(PROMPTS[1], params(1))
    engine.step()
    failed = engine.fail_running("boom")
    assert [(d.request_id, d.finish_reason, d.error) for d in failed] == [(first, "error", "boom")]
    tokens, last = run_all(engine)
    assert last[second].finish_reason == "length" and len(tokens[second]) == params(1).max_tokens
    assert engine.pool_usage().idle
