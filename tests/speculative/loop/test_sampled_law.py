"""(b) Sampled speculative decoding keeps the target's law, through the whole loop.

The first three committed tokens of a request (the prefill's sample, then what the verifies
commit with k = 2) are drawn many times with different seeds and their joint law is compared
with the target's exact law p(t1) p(t2 | t1) p(t3 | t1, t2), enumerated with the reference
(top_k = 3 keeps it to 27 cells). Every cell must lie within 5 standard errors. The verifier
alone is proved more tightly (exact enumeration, 1e5-row Monte Carlo) in tests/speculative/verify/; this
test shows that the loop around it (anchors, rollback, proposer state, keyed randomness)
preserves that law for every proposer, including one whose q differs from p.

Planted bug: a proposer that draws from one distribution but reports another q must fail.
"""

from __future__ import annotations

import math

import pytest

from dflash2.reference.speculative.dflash import DFlashProposer
from dflash2.reference.speculative.mtp import MTPProposer
from dflash2.reference.speculative.ngram import NgramProposer
from dflash2.reference.speculative.proposer import Proposal
from dflash2.reference.speculative.law import exact_sequence_law, worst_deviation
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.loop import speculative_generate

from oracles import NoisyTargetProposer

PROMPT = [7, 21, 7, 21, 7, 3]
NUM_TOKENS = 3


def sampling(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)


def exact_law(target) -> dict[tuple[int, ...], float]:
    return exact_sequence_law(target, PROMPT, NUM_TOKENS, sampling(0))


def sampled_outputs(target, new_proposer, runs: int) -> list[tuple[int, ...]]:
    return [tuple(speculative_generate(target, new_proposer(), PROMPT, sampling(seed), k=2).token_ids)
            for seed in range(runs)]


class MisreportingProposer(NoisyTargetProposer):
    """Planted bug: drafts from the flattened q but tells the verifier q = p restricted (renormalised)."""

    def propose(self, anchor_token, anchor_position, k, params) -> Proposal:
        honest = super().propose(anchor_token, anchor_position, k, params)
        lie = honest.draft_probs ** (1 / self.flatten)
        return Proposal(honest.tokens, honest.cand_ids, lie / lie.sum(-1, keepdim=True))


@pytest.mark.parametrize("stack", ["tiny-dense"], indirect=True)
@pytest.mark.parametrize("name,runs", [("noisy-target", 800), ("mtp", 300), ("dflash", 300), ("ngram", 300)])
def test_committed_tokens_follow_the_target_law(stack, name, runs):
    target = stack.target
    new_proposer = {
        "noisy-target": lambda: NoisyTargetProposer(target),
        "mtp": lambda: MTPProposer(stack.mtp),
        "dflash": lambda: DFlashProposer(stack.draft(2)),
        "ngram": lambda: NgramProposer(),
    }[name]
    exact = exact_law(target)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)
    assert worst_deviation(exact, sampled_outputs(target, new_proposer, runs)) < 5.0


@pytest.mark.parametrize("stack", ["tiny-dense"], indirect=True)
def test_planted_bug_misreported_q_breaks_the_law(stack):
    runs = 800
    outputs = sampled_outputs(stack.target, lambda: MisreportingProposer(stack.target), runs)
    assert worst_deviation(exact_law(stack.target), outputs) > 5.0

