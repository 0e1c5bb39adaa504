"""The scheduler's bookkeeping on its own: page reservations and allocation, admission, prefill chunking,
decode plans, per-request k, finish conditions, and a randomized run checked after every step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2.reference.request.stopping import Stopper
from dflash2.fast.engine.scheduler import (DecodePlan, PrefillPlan, Req, ReqStatus, Scheduler,
                                           pages_for)
from dflash2.reference.request.sampling_params import SamplingParams


def req(rid: int, prompt_len: int, max_tokens: int, **params) -> Req:
    return Req(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **params), max_tokens)


def scheduler(**kw) -> Scheduler:
    args = dict(max_running_req=2, max_num_batched_tokens=8, page_size=4, num_pages=16, k=0,
                max_model_len=1000)
    return Scheduler(**{**args, **kw})


def run_prefill(s: Scheduler, plan: PrefillPlan, first_token: int = 7) -> None:
    """What the engine does with a prefill plan's results."""
    for chunk in plan.chunks:
        chunk.req.num_prefilled += chunk.length
        if chunk.completes_prompt:
            chunk.req.output_ids.append(first_token)


def test_admission_reserves_the_whole_budget_and_allocates_pages_lazily():
    s = scheduler()
    a = req(0, 6, 10)  # 16 tokens: 4 pages reserved
    s.add(a)
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan) and [(c.start, c.length) for c in plan.chunks] == [(0, 6)]
    assert a.status is ReqStatus.RUNNING and a.slot == 0
    assert len(a.pages) == 2 and a.reserved_pages == 2  # positions 0..5 have a home
    assert s.pages.available == 16 - 4
    run_prefill(s, plan)
    plan = s.schedule()
    assert isinstance(plan, DecodePlan) and plan.reqs == [a] and plan.ks == [0]
    assert len(a.pages) == 2  # the anchor at position 6 still fits page 1
    a.output_ids += [1, 2]  # anchor now at position 8
    s.schedule()
    assert len(a.pages) == 3 and a.reserved_pages == 1
    s.finish(a, "stop")
    assert s.pages.available == 16 and len(s.pages.free_pages) == 16 and s.free_slots == type(s.free_slots)([1, 0])
    assert a.pages == [] and a.slot == -1 and s.finished == [a] and not s.has_work


def test_admission_waits_for_a_slot_and_keeps_fifo_order():
    s = scheduler(max_num_batched_tokens=100)
    reqs = [req(i, 3, 2) for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    assert [c.req for c in plan.chunks] == reqs[:2] and list(s.waiting) == [reqs[2]]
    run_prefill(s, plan)
    assert isinstance(s.schedule(), DecodePlan)  # no free slot: decode the two running
    s.finish(reqs[0], "length")
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan) and [c.req for c in plan.chunks] == [reqs[2]] and reqs[2].slot == 0


def test_head_of_queue_blocks_on_pages_without_overtaking():
    s = scheduler(num_pages=6, max_running_req=3, max_num_batched_tokens=100)
    big, huge, small = req(0, 8, 8), req(1, 8, 8), req(2, 1, 1)  # 4, 4 and 1 pages
    for r in (big, huge, small):
        s.add(r)
    plan = s.schedule()
    assert [c.req for c in plan.chunks] == [big]  # huge does not fit (2 pages left); small waits behind it
    assert list(s.waiting) == [huge, small]
    run_prefill(s, plan)
    s.finish(big, "stop")
    plan = s.schedule()
    assert [c.req for c in plan.chunks] == [huge, small]


def test_a_request_larger_than_the_cache_is_refused_at_once():
    s = scheduler(num_pages=4)
    r = req(0, 10, 7)  # 17 tokens: 5 pages
    s.add(r)
    assert r.finished and r.finish_reason == "error" and "expected at most the 4 pages" in r.error
    assert not s.has_work and s.pages.available == 4


def test_chunked_prefill_continues_unfinished_prompts_first_within_the_budget():
    s = scheduler(max_num_batched_tokens=8, max_running_req=3)
    long, short, third = req(0, 19, 2), req(1, 3, 2), req(2, 2, 2)
    for r in (long, short, third):
        s.add(r)
    steps = []
    while True:
        plan = s.schedule()
        if not isinstance(plan, PrefillPlan):
            break
        steps.append([(c.req.rid, c.start, c.length) for c in plan.chunks])
        assert sum(c.length for c in plan.chunks) <= 8
        run_prefill(s, plan)
    assert steps == [[(0, 0, 8)], [(0, 8, 8)], [(0, 16, 3), (1, 0, 3), (2, 0, 2)]]
    assert isinstance(plan, DecodePlan) and plan.reqs == [long, short, third]


def test_decode_steps_go_between_the_chunks_of_a_long_prompt():
    """A request decoding while a 9-token prompt prefills in chunks of 4 waits one chunk at a time; with nothing
    decoding, the chunks run back to back."""
    s = scheduler(max_num_batched_tokens=4)
    a, b = req(0, 2, 5), req(1, 9, 5)
    s.add(a)
    run_prefill(s, s.schedule())
    s.add(b)
    kinds = []
    for _ in range(6):
        plan = s.schedule()
        kinds.append(type(plan).__name__)
        if isinstance(plan, PrefillPlan):
            run_prefill(s, plan)
        else:
            assert plan.reqs == [r for r in (a, b) if r.prefill_done]
            for r in plan.reqs:
                r.output_ids.append(1)
    # b's first chunk goes first (the step before was a's own prefill, which stalled nobody); then they alternate
    assert kinds == ["PrefillPlan", "DecodePlan"] * 3
    c = req(2, 9, 5)
    s.finish(a, "stop")
    s.finish(b, "stop")
    s.add(c)
    plans = [s.schedule() for _ in range(3)]
    for plan in plans:
        assert isinstance(plan, PrefillPlan)
        run_prefill(s, plan)


def test_chunks_are_bounded_by_busy_chunk_rows_only_while_requests_decode():
    """With requests decoding, each chunk has at most busy_chunk_rows rows (the captured prefill steps' bound), and
    the step packs several such chunks; with nothing decoding, a chunk fills the budget."""
    s = scheduler(max_running_req=3, max_num_batched_tokens=12, num_pages=32, busy_chunk_rows=3)
    a, b, c = req(0, 10, 5), req(1, 7, 5), req(2, 2, 5)
    s.add(a)
    plan = s.schedule()
    assert [ch.length for ch in plan.chunks] == [10]  # nothing decodes: the whole prompt in one chunk
    run_prefill(s, plan)
    s.add(b)
    s.add(c)
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan) and [(ch.req, ch.length) for ch in plan.chunks] == [(b, 3), (c, 2)]
    run_prefill(s, plan)
    plan = s.schedule()  # a waited one prefill step: its turn
    assert isinstance(plan, DecodePlan) and plan.reqs == [a, c]
    for r in plan.reqs:
        r.output_ids.append(1)
    plan = s.schedule()
    assert [(ch.req, ch.start, ch.length) for ch in plan.chunks] == [(b, 3, 3)]


def test_prompts_arriving_while_one_prefills_run_back_to_back_with_it():
    """a's prefill step produces its first token and stalls nobody, so b (arrived meanwhile) prefills next; b's
    step stalled a, so a decodes before c's prefill."""
    s = scheduler(max_running_req=3, max_num_batched_tokens=4)
    a, b, c = req(0, 3, 5), req(1, 3, 5), req(2, 3, 5)
    s.add(a)
    plan = s.schedule()
    s.add(b)
    run_prefill(s, plan)
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan) and [ch.req for ch in plan.chunks] == [b]
    s.add(c)
    run_prefill(s, plan)
    plan = s.schedule()
    assert isinstance(plan, DecodePlan) and plan.reqs == [a, b]
    for r in plan.reqs:
        r.output_ids.append(1)
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan) and [ch.req for ch in plan.chunks] == [c]


def test_k_shrinks_near_the_end_and_is_zero_with_one_token_left():
    s = scheduler(k=3, max_num_batched_tokens=100)
    r = req(0, 4, 6)
    s.add(r)
    run_prefill(s, s.schedule())  # one output token
    ks = []
    for emitted in ([1, 1, 1], [1], [1]):
        plan = s.schedule()
        ks.append(plan.ks[0])
        r.output_ids += emitted
    assert ks == [3, 1, 0]  # 5 tokens left, then 2, then 1
    last_position = r.anchor_position  # the k = 0 step writes only the anchor's row
    assert len(r.pages) == pages_for(last_position + 1, 4) <= pages_for(r.budget_tokens, 4)


def check_finished(r: Req, new_tokens: list[int]) -> str | None:
    """What the engine does after a step: the reference's Stopper over the grown output."""
    r.output_ids, reason = Stopper(r.params, (), None, r.max_new_tokens).check(r.output_ids + new_tokens)
    return reason


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.sampled_from([0, 1, 3]), page_size=st.sampled_from([1, 3, 4]))
def test_random_runs_keep_every_page_and_slot_accounted(seed, k, page_size):
    rng = random.Random(seed)
    s = scheduler(k=k, page_size=page_size, num_pages=40, max_running_req=3,
                  max_num_batched_tokens=rng.choice([1, 5, 16]))
    reqs = [req(i, rng.randint(1, 20), rng.randint(1, 12)) for i in range(rng.randint(1, 8))]
    arriving = list(reqs)  # some at once, the rest one by one between steps
    for _ in range(rng.randint(1, len(arriving))):
        s.add(arriving.pop(0))
    prefill_steps_since_token: dict[int, int] = {}  # decoding request -> prefill steps it has waited through
    for _ in range(500):
        if arriving and rng.random() < 0.3:
            s.add(arriving.pop(0))
        if not s.has_work:
            if not arriving:
                break
            continue
        plan = s.schedule()
        if isinstance(plan, PrefillPlan):
            for rid in prefill_steps_since_token:
                prefill_steps_since_token[rid] += 1
                assert prefill_steps_since_token[rid] <= 1, "a decoding request waited through two prefill steps"
            run_prefill(s, plan)
            for c in plan.chunks:
                assert c.req.pages and len(c.req.pages) * page_size >= c.start + c.length
                if c.completes_prompt:
                    prefill_steps_since_token[c.req.rid] = 0
                    if check_finished(c.req, []):
                        s.finish(c.req, "length")
        else:
            for r, k_req in zip(plan.reqs, plan.ks):
                assert 0 <= k_req <= k and r.anchor_position + k_req < r.budget_tokens
                assert len(r.pages) * page_size >= r.anchor_position + k_req + 1
                prefill_steps_since_token[r.rid] = 0
                if check_finished(r, [5] * rng.randint(1, k_req + 1)):
                    s.finish(r, "length")
        prefill_steps_since_token = {rid: n for rid, n in prefill_steps_since_token.items()
                                     if not reqs[rid].finished}
        running = s.running
        assert len(running) <= 3 and len({r.slot for r in running}) == len(running)
        held = [p for r in running for p in r.pages]
        assert len(set(held)) == len(held) and not set(held) & set(s.pages.free_pages)
        assert len(held) + len(s.pages.free_pages) == 40
        assert s.pages.reserved == sum(r.reserved_pages for r in running)
        assert all(len(r.pages) + r.reserved_pages == pages_for(r.budget_tokens, page_size) for r in running)
    assert not s.has_work and s.pages.available == 40 and len(s.free_slots) == 3
    assert all(r.finished and len(r.output_ids) == r.max_new_tokens for r in reqs)
