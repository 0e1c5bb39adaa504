"""Monte Carlo of the full sampled verify: drafts drawn from q, uniforms drawn fresh, 10^5 rows.

The empirical law of the first committed token must match the target's p_1, and the accepted
count its analytic law P(a >= i) = sum over draft prefixes y_1..y_i of prod_j q_j(y_j) acc_j, with
acc_j = min(1, p_j(y_j) / q_j(y_j)) on a trusted row and 0 on an untrusted one; every bin within 5
standard deviations (a bin of probability 0 must stay empty).
"""

from __future__ import annotations

import math

import torch

from dflash2.reference.speculative.verify import verify_sampled, verify_sampled_keyed
from verify_toys import V, draft_paths, key, target_p, trusted_q, verify_inputs

K_DRAFTS, NUM_CANDS = 3, 3


def accepted_count_law(scenario: str, root: tuple[int, ...]) -> list[float]:
    """P(num_accepted = a), a = 0..k, from the formula in the module docstring."""
    at_least = [1.0]
    for i in range(1, K_DRAFTS + 1):
        total = 0.0
        for tokens, rows, w in draft_paths(scenario, root, i, NUM_CANDS):
            for j, (y, row) in enumerate(zip(tokens, rows)):
                q = trusted_q(row, y)
                w *= 0.0 if q is None else min(1.0, float(target_p(root + tokens[:j])[y] / q[y]))
            total += w
        at_least.append(total)
    return [at_least[a] - (at_least[a + 1] if a < K_DRAFTS else 0.0) for a in range(K_DRAFTS + 1)]


def assert_within_5_sigma(counts: list[int], law: list[float]) -> None:
    n = sum(counts)
    for b, (c, pi) in enumerate(zip(counts, law)):
        if pi == 0.0:
            assert c == 0, f"bin {b}: {c} draws of a zero-probability outcome"
        else:
            sigma = math.sqrt(n * pi * (1 - pi))
            assert abs(c - n * pi) <= 5 * sigma, f"bin {b}: {c} draws, expected {n * pi:.1f} +- {sigma:.1f}"


def sample_paths(scenario: str, root: tuple[int, ...], num_rows: int, gen: torch.Generator):
    """Full draft paths drawn from the proposer's law, and the verifier's inputs for each path."""
    paths = draft_paths(scenario, root, K_DRAFTS, NUM_CANDS)
    weights = torch.tensor([w for _, _, w in paths], dtype=torch.float64)
    picks = torch.multinomial(weights, num_rows, replacement=True, generator=gen).tolist()
    inputs = [verify_inputs(root, tokens, rows) for tokens, rows, _ in paths]
    return picks, inputs


def test_first_token_and_accepted_count_laws_over_1e5_rows():
    root = (0, 1)  # p_1 has a zero-probability token here
    assert float(target_p(root).min()) == 0.0
    num_rows = 100_000
    gen = torch.Generator().manual_seed(20240601)
    picks, inputs = sample_paths("sparse", root, num_rows, gen)
    uniforms = torch.rand(num_rows, K_DRAFTS + 2, dtype=torch.float64, generator=gen).tolist()
    first, accepted = [0] * V, [0] * (K_DRAFTS + 1)
    for pick, u in zip(picks, uniforms):
        result = verify_sampled(**inputs[pick], accept_u=u[:K_DRAFTS], residual_u=u[K_DRAFTS], bonus_u=u[K_DRAFTS + 1])
        first[result.emitted[0]] += 1
        accepted[result.num_accepted] += 1
    assert_within_5_sigma(first, target_p(root).tolist())
    law = accepted_count_law("sparse", root)
    assert min(law) > 0.01  # every count is exercised
    assert_within_5_sigma(accepted, law)


def test_keyed_uniforms_with_untrusted_rows():
    root = (0, 0)  # a trusted first row; later rows mix every untrusted kind
    assert key(root, 6) % 6 == 0  # untrusted_mix_row's kind 0 at the root: a trusted row
    num_rows, seed = 20_000, 99
    gen = torch.Generator().manual_seed(7)
    picks, inputs = sample_paths("untrusted_mix", root, num_rows, gen)
    first, accepted = [0] * V, [0] * (K_DRAFTS + 1)
    for anchor, pick in enumerate(picks):  # one anchor position per row: fresh keys
        result = verify_sampled_keyed(**inputs[pick], seed=seed, anchor_position=anchor)
        first[result.emitted[0]] += 1
        accepted[result.num_accepted] += 1
    assert_within_5_sigma(first, target_p(root).tolist())
    assert_within_5_sigma(accepted, accepted_count_law("untrusted_mix", root))
