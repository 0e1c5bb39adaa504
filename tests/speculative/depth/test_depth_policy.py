"""fast/speculative/depth.py: the expected tokens of a depth, and the adaptive policy's choices against a simulated
machine whose step costs and acceptance are known (so the best depth is known)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2.fast.speculative.depth import (AdaptiveDepth, FixedDepth, batch_bucket, default_depths, depth_policy,
                                            expected_tokens)


def test_expected_tokens_is_one_plus_the_sums_of_the_acceptance_products():
    alpha = np.array([0.8, 0.5, 0.5])
    assert expected_tokens(alpha) == pytest.approx([1.0, 1.8, 2.2, 2.4])
    assert expected_tokens(np.ones(7))[-1] == 8.0 and expected_tokens(np.zeros(7)).tolist() == [1.0] * 8


def test_buckets_and_default_depths():
    assert [batch_bucket(n) for n in (1, 2, 3, 8, 9, 64)] == [1, 2, 4, 8, 16, 64]
    assert default_depths(7) == (0, 1, 3, 7) and default_depths(2) == (0, 1, 2) and default_depths(1) == (0, 1)


class Machine:
    """Step time a + b * B * (k + 1) (the verify's rows) and a fixed per-position acceptance alpha."""

    def __init__(self, a: float, b: float, alpha: float, seed: int = 0):
        self.a, self.b, self.alpha = a, b, alpha
        self.rng = np.random.default_rng(seed)

    def seconds(self, num_seqs: int, k: int) -> float:
        return (self.a + self.b * num_seqs * (k + 1)) * (1 + 0.02 * self.rng.standard_normal())

    def accepted(self, num_seqs: int, k: int) -> list[int]:
        passes = self.rng.random((num_seqs, k)) < self.alpha
        return [int(np.argmin(np.append(row, False))) for row in passes]  # the accepted prefix's length

    def best(self, num_seqs: int, depths) -> int:
        gain = expected_tokens(np.full(max(depths), self.alpha))
        return max(depths, key=lambda d: gain[d] / (self.a + self.b * num_seqs * (d + 1)))


def run(policy: AdaptiveDepth, machine: Machine, num_seqs: int, steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = policy.choose(num_seqs)
        policy.record(num_seqs, k, machine.seconds(num_seqs, k), [k] * num_seqs, machine.accepted(num_seqs, k)
                      if k else [0] * num_seqs)
        chosen.append(k)
    return chosen


@pytest.mark.parametrize("num_seqs,b,alpha", [(1, 0.01, 0.8), (8, 0.5, 0.8), (64, 0.5, 0.8), (8, 0.05, 0.1)])
def test_the_policy_settles_on_the_best_depth_of_the_machine(num_seqs, b, alpha):
    machine = Machine(a=1.0, b=b, alpha=alpha)
    policy = AdaptiveDepth(7)
    chosen = run(policy, machine, num_seqs, 400)
    best = machine.best(num_seqs, policy.depths)
    settled = chosen[100:]
    assert settled.count(best) >= 0.95 * len(settled), (best, {d: settled.count(d) for d in policy.depths})
    assert policy.alpha[0] == pytest.approx(alpha, abs=0.12)  # deeper positions are rarely tested at low alpha


def test_the_extremes_are_deepest_alone_and_plain_decoding_when_rows_are_dear():
    cheap_rows = Machine(a=1.0, b=0.001, alpha=0.8)
    assert cheap_rows.best(1, (0, 1, 3, 7)) == 7 and run(AdaptiveDepth(7), cheap_rows, 1, 200)[-1] == 7
    dear_rows = Machine(a=0.1, b=1.0, alpha=0.3)
    assert dear_rows.best(64, (0, 1, 3, 7)) == 0 and run(AdaptiveDepth(7), dear_rows, 64, 200)[-1] == 0


def test_a_fresh_bucket_measures_every_depth_twice_deepest_first_and_drops_the_first_sample():
    policy = AdaptiveDepth(7)
    order = []
    for _ in range(8):
        k = policy.choose(4)
        order.append(k)
        policy.record(4, k, 100.0 if policy.costs.get((4, k)) is None else 1.0 + k, [k] * 4, [0] * 4)
    assert order == [7, 7, 3, 3, 1, 1, 0, 0]
    assert {d: policy.costs[(4, d)].seconds for d in policy.depths} == {0: 1.0, 1: 2.0, 3: 4.0, 7: 8.0}


def test_a_changed_cost_is_seen_again_by_exploration():
    machine = Machine(a=1.0, b=0.001, alpha=0.8)
    policy = AdaptiveDepth(7, explore_every=16)
    assert run(policy, machine, 2, 100)[-1] == 7
    machine.b = 1.0  # rows turn dear (e.g. other work shares the GPU)
    assert run(policy, machine, 2, 300)[-20:].count(machine.best(2, policy.depths)) >= 15  # two explorations, ties


def test_only_uniform_steps_price_a_depth_but_every_step_feeds_the_acceptance():
    policy = AdaptiveDepth(7)
    policy.record(2, 7, 5.0, [7, 3], [7, 3])  # a ragged step: a request near its end drafted 3
    assert policy.costs == {}
    assert policy.tested[:4] == pytest.approx([3, 3, 3, 2], abs=0.05)  # prior 1 (aged) + two requests at 1..3, one at 4
    assert policy.accepted[:4] == pytest.approx([2.5, 2.5, 2.5, 1.5], abs=0.05)


def test_fixed_depth_and_refusals():
    fixed = depth_policy("fixed", 5)
    assert isinstance(fixed, FixedDepth) and fixed.choose(64) == 5 and not fixed.adaptive
    assert depth_policy("adaptive", 5).depths == (0, 1, 3, 5)
    with pytest.raises(ValueError, match="speculative_depth='deep'"):
        depth_policy("deep", 5)
    with pytest.raises(ValueError, match="depths=\\(0, 9\\)"):
        AdaptiveDepth(7, depths=(0, 9))


def test_a_step_that_captured_a_graph_prices_nothing_but_feeds_the_acceptance():
    """``seconds=None`` (the engine's mark of a step that captured a graph): no cost sample, but the acceptance counts."""
    policy = AdaptiveDepth(7)
    for seconds in (9.0, 1.0):  # the first sample of (bucket 2, depth 7) is dropped, the second kept
        policy.record(2, 7, seconds, [7, 7], [0, 0])
    policy.record(2, 7, None, [7, 7], [7, 7])  # a new page bucket's capture: 50x the step
    assert policy.costs[(2, 7)].seconds == 1.0 and policy.costs[(2, 7)].samples == 2
    assert policy.accepted[0] > 0.5 * 2  # the two requests that kept all seven still count
