"""The engine with its prefix cache under a Hypothesis state machine of arrivals (new prompts, prompts sharing a
prefix, next turns of finished conversations), steps, aborts and evictions, against a dict model: prompt ->
the greedy tokens a cold engine (no prefix cache) gives it.

After every rule the pools account for every page and slot (``Engine.pool_usage``: each page's references equal
its holders, requests and snapshots); every request that finishes has its model tokens, whatever it resumed
from; at the end, with every request ended and the cache cleared, the pools are as at startup. Two request slots
and three snapshot slots on a tiny DFlash pair, snapshots every 16 tokens: hits, evictions and slot reuse all
the time. Derandomized, so a run is the same run every time.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.engine.engine import Engine
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target

BASES = [[(5 * i + 2) % 97 + 1 for i in range(40)], [(11 * i + 7) % 89 + 3 for i in range(40)]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-machine")
    target = write_tiny_target(root / "target", "tiny-dense", tokenizer=None)
    return target, write_tiny_draft(root / "draft", target, seed=3)


def make_engine(pair, prefix_caching: bool) -> Engine:
    target, draft = pair
    return Engine(EngineConfig(model_path=str(target), speculative_algorithm="dflash",
                               speculative_draft_model_path=str(draft), device="cpu", dtype="float32",
                               max_running_req=2, cpu_cache_bytes=16 << 20, max_model_len=200,
                               speculative_depth="fixed", snapshot_interval=16, prefix_snapshots=3,
                               prefix_caching=prefix_caching))


class EngineMachine(RuleBasedStateMachine):
    pair = None  # set by the test
    seen = {"hits": 0, "evictions": 0, "aborts": 0, "turns": 0}  # over every example: the machine did reach them

    @initialize()
    def start(self):
        self.engine = make_engine(self.pair, True)
        self.cold = make_engine(self.pair, False)
        self.idle = self.engine.pool_usage()
        self.expected: dict[tuple[int, ...], list[int]] = {}  # the dict model: prompt -> cold greedy tokens
        self.live: dict[int, tuple[list[int], int]] = {}  # request id -> (prompt, max_tokens)
        self.got: dict[int, list[int]] = {}
        self.histories: list[list[int]] = []  # finished conversations: prompt + output

    def model(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        if len(self.expected.get(key, ())) < max_tokens:
            out = self.cold.generate([prompt], [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True)])[0]
            self.expected[key] = out.token_ids
        return self.expected[key][:max_tokens]

    def add(self, prompt: list[int], max_tokens: int) -> None:
        rid = self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self.live[rid], self.got[rid] = (prompt, max_tokens), []

    @rule(base=st.integers(0, 1), shared=st.integers(1, 40), tail=st.lists(st.integers(1, 50), max_size=6),
          max_tokens=st.integers(1, 24))
    def arrive(self, base, shared, tail, max_tokens):
        self.add(BASES[base][:shared] + tail, max_tokens)

    @precondition(lambda self: self.histories)
    @rule(which=st.integers(0, 50), more=st.lists(st.integers(1, 50), min_size=1, max_size=4),
          max_tokens=st.integers(1, 16))
    def next_turn(self, which, more, max_tokens):
        history = self.histories[which % len(self.histories)]
        if len(history) + len(more) + max_tokens <= 200:
            self.add(history + more, max_tokens)
            self.seen["turns"] += 1

    @precondition(lambda self: self.engine.has_unfinished)
    @rule()
    def step(self):
        self.one_step()

    @precondition(lambda self: self.engine.has_unfinished)
    @rule()
    def run_until_one_finishes(self):
        for _ in range(60):
            if self.one_step() or not self.engine.has_unfinished:
                return

    def one_step(self) -> bool:
        """One engine step; whether a request finished."""
        finished = False
        for delta in self.engine.step():
            if delta.request_id not in self.live:
                continue
            self.got[delta.request_id] += delta.token_ids
            if delta.finished:
                prompt, max_tokens = self.live.pop(delta.request_id)
                assert self.got[delta.request_id] == self.model(prompt, max_tokens), f"prompt {prompt}"
                self.histories.append(prompt + self.got[delta.request_id])
                finished = True
        return finished

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 50))
    def abort(self, which):
        rid = sorted(self.live)[which % len(self.live)]
        assert self.engine.abort(rid).finish_reason == "abort"
        del self.live[rid]
        self.seen["aborts"] += 1

    @rule()
    def evict(self):
        self.engine.prefix_cache.evict_one()

    @invariant()
    def pools_account_for_everything(self):
        if hasattr(self, "engine"):
            self.engine.pool_usage()  # raises on a leak, a double free or a miscounted reference

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for rid in list(self.live):
            self.engine.abort(rid)
        while self.engine.has_unfinished or self.engine.runner.in_flight is not None:
            self.engine.step()
        stats = self.engine.prefix_cache.stats
        self.seen["hits"] += stats.hits
        self.seen["evictions"] += stats.evictions
        self.engine.clear_prefix_cache()
        assert self.engine.pool_usage() == self.idle


def test_the_engine_and_its_prefix_cache_against_a_dict(pair):
    EngineMachine.pair = pair
    run_state_machine_as_test(EngineMachine, settings=settings(max_examples=12, stateful_step_count=25, deadline=None,
                                                               derandomize=True))
    assert all(EngineMachine.seen.values()), EngineMachine.seen
