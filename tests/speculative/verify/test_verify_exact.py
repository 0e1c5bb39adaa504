"""Exactness by exact enumeration: the committed tokens of sampled verification follow the target.

On a 4-token vocabulary with a prefix-dependent target and path-conditional sparse drafts
(``verify_toys.py``), every draft path is enumerated with its probability and the verifier is
integrated exactly over its uniforms; the law of the first n committed tokens (n = 1, 2, 3: with
k = 2, n = 3 reaches the bonus token, and a rejection at slot 1 makes the next step supply the
rest) must equal the target's to 1e-12. The spec's own formulas (min(1, p/q), the residual law)
are held to the same bound, and planted bugs in the verifier must break it.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.reference.speculative import verify as verify_module
from dflash2.reference.speculative.verify import verify_sampled
from verify_toys import SCENARIOS, committed_law, max_law_error, step_law_of, target_law

REAL_DRAFT_ROW = verify_module.draft_row_on_vocab
K_DRAFTS = 2
ROOTS = [(0,), (2, 3)]


def law_error(verify, scenario, num_cands, max_n, roots=ROOTS, **kw) -> float:
    """The largest gap to the target's law of the first n <= max_n committed tokens, over roots."""
    step_law = step_law_of(verify, scenario, K_DRAFTS, num_cands, **kw)  # memoised across n and roots
    return max(max_law_error(committed_law(step_law, root, n), target_law(root, n))
               for root in roots for n in range(1, max_n + 1))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("root", ROOTS)
def test_the_spec_formulas_keep_the_target_law(scenario, root):
    for num_cands in (2, 3):
        assert law_error(None, scenario, num_cands, 3, [root], analytic=True) < 1e-12


@pytest.mark.parametrize("scenario,num_cands", [
    ("sparse", 2), ("sparse", 3), ("one_hot", 1), ("wrong_total", 2), ("wrong_total", 3), ("nan", 2),
    ("untrusted_mix", 2), ("untrusted_mix", 3),
])
def test_verify_sampled_keeps_the_target_law(scenario, num_cands):
    assert law_error(verify_sampled, scenario, num_cands, 2) < 1e-12


@pytest.mark.parametrize("scenario,num_cands", [("sparse", 2), ("one_hot", 1), ("untrusted_mix", 2)])
def test_verify_sampled_keeps_the_law_of_three_tokens(scenario, num_cands):
    assert law_error(verify_sampled, scenario, num_cands, 3, ROOTS[:1]) < 1e-12


def test_the_verifier_is_constant_on_every_cell():
    """Certifies the integral itself: no cut of the verifier falls inside a cell."""
    assert law_error(verify_sampled, "untrusted_mix", 3, 1, certify=True) < 1e-12


def test_the_toy_world_reaches_every_outcome_length():
    """Drafts differ from the target: a step may emit 1, 2 or 3 tokens, so all branches are integrated."""
    step_law = step_law_of(verify_sampled, "sparse", K_DRAFTS, 2)
    lengths = {len(e) for e in step_law((0,))}
    assert lengths == {1, 2, 3}


# -- planted bugs: each must break exactness ------------------------------------------------------

def accepts_q_over_p(u, q_token, p_token):
    return u * p_token < q_token  # min(1, q/p)


def row_not_renormalised(cand_ids, draft_probs, token, vocab_size):
    q = draft_probs.double()
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()) or float(q.sum()) <= 0:
        return None
    q_vocab = torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, cand_ids, q)
    return q_vocab if float(q_vocab[token]) > 0 else None


def residual_is_p(p, q_vocab):
    return p


def untrusted_row_as_one_hot(cand_ids, draft_probs, token, vocab_size):
    """An untrusted row read as a one-hot draft: exact only if the proposer picked y deterministically."""
    q_vocab = REAL_DRAFT_ROW(cand_ids, draft_probs, token, vocab_size)
    if q_vocab is None:
        q_vocab = torch.zeros(vocab_size, dtype=torch.float64)
        q_vocab[token] = 1.0
    return q_vocab


@pytest.mark.parametrize("name,replacement,scenario,num_cands", [
    ("accepts", accepts_q_over_p, "sparse", 2),
    ("draft_row_on_vocab", row_not_renormalised, "wrong_total", 2),
    ("residual_probs", residual_is_p, "sparse", 2),
    ("draft_row_on_vocab", untrusted_row_as_one_hot, "untrusted_mix", 3),
])
def test_planted_verifier_bug_breaks_exactness(monkeypatch, name, replacement, scenario, num_cands):
    monkeypatch.setattr(verify_module, name, replacement)
    assert law_error(verify_sampled, scenario, num_cands, 2) > 1e-2
