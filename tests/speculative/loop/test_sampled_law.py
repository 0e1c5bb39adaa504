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
import torch

from dflash2.reference.speculative.dflash import DFlashProposer
from dflash2.reference.speculative.mtp import MTPProposer
from dflash2.reference.speculative.ngram import NgramProposer
from dflash2.reference.speculative.proposer import Proposal
from dflash2.reference.speculative.sampling import target_probs
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.loop import speculative_generate

from oracles import NoisyTargetProposer

PROMPT = [7, 21, 7, 21, 7, 3]
NUM_TOKENS = 3


def sampling(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)


def exact_law(target) -> dict[tuple[int, ...], float]:
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        grown = {}
        for prefix, mass in law.items():
            p = target_probs(target.forward(torch.tensor(PROMPT + list(prefix))).logits[-1], sampling(0))
            for t in torch.nonzero(p).flatten().tolist():
                grown[prefix + (t,)] = mass * float(p[t])
        law = grown
    return law


def empirical_law(target, new_proposer, runs: int) -> dict[tuple[int, ...], float]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        out = speculative_generate(target, new_proposer(), PROMPT, sampling(seed), k=2).token_ids
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return {cell: n / runs for cell, n in counts.items()}


def worst_deviation(exact, empirical, runs: int) -> float:
    """The largest |empirical - exact| in standard errors, over every cell either law gives mass."""
    worst = 0.0
    for cell in set(exact) | set(empirical):
        p, f = exact.get(cell, 0.0), empirical.get(cell, 0.0)
        if p == 0.0:
            return math.inf  # a sequence the target cannot produce
        worst = max(worst, abs(f - p) / math.sqrt(p * (1 - p) / runs))
    return worst


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
    assert worst_deviation(exact, empirical_law(target, new_proposer, runs), runs) < 5.0


@pytest.mark.parametrize("stack", ["tiny-dense"], indirect=True)
def test_planted_bug_misreported_q_breaks_the_law(stack):
    runs = 800
    law = empirical_law(stack.target, lambda: MisreportingProposer(stack.target), runs)
    assert worst_deviation(exact_law(stack.target), law, runs) > 5.0

