"""How many drafts a speculative step asks for: a fixed k, or the depth that commits the most tokens per second.

A step of depth k over B requests costs T(B, k) seconds and commits, per request, E(k) tokens on average:

    E(k) = 1 + sum_{i=1..k} prod_{j=1..i} alpha_j

with alpha_j the probability that draft j is accepted given drafts 1..j-1 were (the verify keeps a prefix). k = 0 is
plain decoding (the step verifies no draft and commits the target's own token), so E(0) = 1. The adaptive policy
picks, before each step, the candidate depth with the largest E(k) / T(B, k): at one request and good acceptance
that is the deepest; when B requests make a verify's k + 1 rows per request cost more than the tokens they add
(the GPU turns compute-bound, or the host's per-request work grows), a shallower one, down to plain decoding.

Both factors are measured, not assumed:

- alpha_j from every step's accepted counts (a request with k_b drafts that kept a tested positions
  1..min(a + 1, k_b) and passed 1..a), as counts decayed by half every ``half_life`` steps (whatever the batch
  size), so a change in the text or the sampling settles within a few dozen steps;
- T(B, k) as a decayed mean of the step's wall time per (batch bucket, k): the engine times each uniform step
  (host work included: it is what a request waits for). A bucket's depth is tried on first use, its first
  sample dropped (a first step compiles kernels or captures a graph), as is any later step that captured a
  graph (the engine passes ``seconds=None``: a new page bucket or sampling mix of the same depth would
  otherwise price the depth at a capture's cost, and the policy would shun it until explored again), and after
  that every
  ``explore_every`` steps of a bucket its least recently measured depth runs once, so a cost that changed is
  seen again; the exploration costs at most one step in ``explore_every``.

The choice depends only on what earlier steps measured, never on the step's own random draws, so every step's
tokens still follow the target's law (sparse-q rejection holds for any k fixed before the draws). Greedy outputs
are the same at every depth. A sampled request's exact tokens, though, depend on the depths its steps ran at (the
keyed uniforms a position uses differ with k), and those depend on timing and load: fixed depth
(``--speculative-depth fixed``; adaptive is the default) keeps a seed's tokens reproducible run to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def batch_bucket(num_seqs: int) -> int:
    """The power of two at or above ``num_seqs``: costs are kept per bucket (a captured step's batch size)."""
    return 1 << max(0, num_seqs - 1).bit_length()


def expected_tokens(alpha: np.ndarray) -> np.ndarray:
    """E(k) for k = 0..len(alpha): 1 + the running sums of the running products of alpha (module docstring)."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(alpha))])


def default_depths(k: int) -> tuple[int, ...]:
    """The candidate depths for an upper bound k: plain decoding, 1, 3 and k (each depth is its own captured graph
    per batch bucket, so the set stays small)."""
    return tuple(sorted({0, min(1, k), min(3, k), k}))


class FixedDepth:
    """Every step drafts k (fewer only near a request's end)."""

    adaptive = False

    def __init__(self, k: int):
        self.k = k
        self.depths = (k,)

    def choose(self, num_seqs: int) -> int:
        return self.k

    def record(self, num_seqs: int, k: int, seconds: float | None, ks: Sequence[int],
               num_accepted: Sequence[int]) -> None:
        pass


@dataclass
class _Cost:
    seconds: float | None = None  # decayed mean; None until a sample past the first
    samples: int = 0
    last_step: int = -1  # the bucket's step count when last measured


@dataclass
class AdaptiveDepth:
    """The policy of the module docstring, over ``depths`` (0 and the upper bound k among them)."""

    k: int
    depths: tuple[int, ...] = ()
    half_life: float = 16.0  # steps after which an observation weighs half
    cost_weight: float = 0.2  # weight of a new step-time sample in its decayed mean
    explore_every: int = 64  # steps of a bucket between two re-measurements of its stalest depth
    prior_alpha: float = 0.5  # alpha_j before any observation of position j (one observation's worth)
    adaptive: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        self.depths = tuple(sorted(set(self.depths or default_depths(self.k))))
        if not self.depths or self.depths[0] < 0 or self.depths[-1] > self.k:
            raise ValueError(f"depths={self.depths}: expected depths in 0..{self.k}")
        self.forget_acceptance()
        self.costs: dict[tuple[int, int], _Cost] = {}
        self.bucket_steps: dict[int, int] = {}
        self.chosen: dict[int, int] = {d: 0 for d in self.depths}  # steps run at each depth (reports)

    def forget_acceptance(self) -> None:
        """Back to the prior alpha (after a warm-up: its prompts say nothing of the traffic's acceptance)."""
        self.accepted = np.full(self.k, self.prior_alpha)  # decayed counts per draft position 1..k
        self.tested = np.ones(self.k)

    @property
    def alpha(self) -> np.ndarray:
        """The current alpha_1..alpha_k."""
        return self.accepted / self.tested

    def choose(self, num_seqs: int) -> int:
        """The depth of the next step of ``num_seqs`` requests."""
        bucket = batch_bucket(num_seqs)
        steps = self.bucket_steps.get(bucket, 0)
        costs = {d: self.costs.get((bucket, d), _Cost()) for d in self.depths}
        unmeasured = [d for d in reversed(self.depths) if costs[d].seconds is None]
        if unmeasured:  # deepest first: a fresh bucket starts where the fixed policy would
            depth = unmeasured[0]
        elif steps and steps % self.explore_every == 0:
            depth = min(self.depths, key=lambda d: costs[d].last_step)
        else:
            gain = expected_tokens(self.alpha)
            depth = max(self.depths, key=lambda d: gain[d] / costs[d].seconds)
        self.chosen[depth] += 1
        return depth

    def record(self, num_seqs: int, k: int, seconds: float | None, ks: Sequence[int],
               num_accepted: Sequence[int]) -> None:
        """A step of depth ``k`` over ``num_seqs`` requests took ``seconds`` (None: not a measure of its cost, e.g.
        it captured a graph); request b drafted ``ks[b]`` and kept ``num_accepted[b]``. Only a uniform step (every
        ks[b] == k) says what depth k costs."""
        bucket = batch_bucket(num_seqs)
        steps = self.bucket_steps[bucket] = self.bucket_steps.get(bucket, 0) + 1
        ks_arr, kept = np.asarray(ks), np.asarray(num_accepted)
        if ks_arr.size and ks_arr.max() > 0:
            positions = np.arange(1, self.k + 1)[None, :]
            tested = (positions <= np.minimum(kept + 1, ks_arr)[:, None]).sum(0)
            passed = (positions <= kept[:, None]).sum(0)
            decay = 0.5 ** (1.0 / self.half_life)
            self.accepted = self.accepted * decay + passed
            self.tested = self.tested * decay + tested
        if seconds is not None and ks_arr.size and (ks_arr == k).all():
            cost = self.costs.setdefault((bucket, k), _Cost())
            cost.samples += 1
            cost.last_step = steps
            if cost.samples > 1:  # the first step of a (bucket, depth) compiles or captures
                cost.seconds = seconds if cost.seconds is None else (
                    (1 - self.cost_weight) * cost.seconds + self.cost_weight * seconds)


def depth_policy(kind: str, k: int) -> FixedDepth | AdaptiveDepth:
    """``EngineConfig.speculative_depth`` to its policy for an upper bound k."""
    if kind == "adaptive":
        return AdaptiveDepth(k)
    if kind == "fixed":
        return FixedDepth(k)
    raise ValueError(f"speculative_depth={kind!r}: expected 'adaptive' or 'fixed'")
