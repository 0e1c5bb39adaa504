"""Sparse-q rejection, case by case: the acceptance threshold, the residual, the bonus, one-hot and
untrusted rows, the keyed uniforms, and refused inputs."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.reference.request.rng import Purpose, uniform
from dflash2.reference.speculative.sampling import sample_from_probs
from dflash2.reference.speculative.verify import VerifyResult, draft_row_on_vocab, residual_probs, verify_sampled, \
    verify_sampled_keyed

P = torch.tensor([[0.1, 0.4, 0.2, 0.3],  # p_1
                  [0.5, 0.1, 0.1, 0.3],  # p_2
                  [0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)  # p_3: the bonus row
CANDS = torch.tensor([[1, 3], [0, 2]])
Q = torch.tensor([[0.8, 0.2], [0.25, 0.75]], dtype=torch.float64)
DRAFTS = torch.tensor([1, 0])  # q_1(1) = 0.8 vs p_1(1) = 0.4: threshold 0.5; q_2(0) = 0.25 < p_2(0): always kept


def run(accept_u, residual_u=0.5, bonus_u=0.5, drafts=DRAFTS, cands=CANDS, q=Q, p=P) -> VerifyResult:
    return verify_sampled(drafts, cands, q, p, accept_u, residual_u, bonus_u)


def test_acceptance_threshold_is_p_over_q():
    assert run([0.4999, 0.999]) == VerifyResult(2, [1, 0, 2])  # both kept, bonus from p_3
    assert run([0.5, 0.999]).num_accepted == 0  # u * q = p is a rejection (strict <)


def test_rejection_draws_from_the_residual():
    # r_1 = max(0, p_1 - q_1) = [0.1, 0, 0.2, 0.1] / 0.4: CDF 0.25, 0.25, 0.75, 1
    for residual_u, token in ((0.2, 0), (0.3, 2), (0.8, 3)):
        assert run([0.9, 0.1], residual_u=residual_u) == VerifyResult(0, [token])
    r = residual_probs(P[0], draft_row_on_vocab(CANDS[0], Q[0], 1, 4))
    torch.testing.assert_close(r, torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64))


def test_residual_without_mass_falls_back_to_p():
    p = torch.tensor([0.0, 0.8, 0.0, 0.2], dtype=torch.float64)
    q = torch.zeros(4, dtype=torch.float64).index_put_((torch.tensor([1, 3]),), torch.tensor([0.8, 0.2]).double())
    assert residual_probs(p, q) is p


def test_one_hot_q_accepts_with_probability_p_and_removes_y_from_the_residual():
    drafts, cands, q = torch.tensor([1]), torch.tensor([[1]]), torch.ones(1, 1)
    p = P[[0, 2]]
    assert run([0.399], drafts=drafts, cands=cands, q=q, p=p).num_accepted == 1  # p_1(1) = 0.4
    assert run([0.401], drafts=drafts, cands=cands, q=q, p=p).num_accepted == 0
    r = residual_probs(P[0], draft_row_on_vocab(cands[0], q[0], 1, 4))
    torch.testing.assert_close(r, torch.tensor([1 / 6, 0.0, 2 / 6, 3 / 6], dtype=torch.float64))


def test_wrong_total_rows_are_renormalised():
    assert run([0.4999, 0.999], q=Q * 3.0) == run([0.4999, 0.999])
    assert run([0.5001, 0.999], q=Q * 0.1) == run([0.5001, 0.999])
    torch.testing.assert_close(draft_row_on_vocab(CANDS[0], Q[0] * 7, 1, 4),
                               torch.tensor([0.0, 0.8, 0.0, 0.2], dtype=torch.float64))


@pytest.mark.parametrize("row,token", [
    ([math.nan, 0.2], 1), ([math.inf, 0.2], 1), ([0.8, -0.1], 1), ([0.0, 0.0], 1),
    ([0.0, 1.0], 1),  # y has no mass in its own row
    ([0.8, 0.2], 2),  # y is not a candidate
])
def test_untrusted_rows_reject_and_draw_from_p(row, token):
    q = torch.tensor([row, [0.25, 0.75]], dtype=torch.float64)
    assert draft_row_on_vocab(CANDS[0], q[0], token, 4) is None
    drafts = torch.tensor([token, 0])
    for residual_u in (0.05, 0.3, 0.6, 0.95):
        # accept_u = 0 would accept any trusted draft with p > 0: the slot must still be rejected
        result = run([0.0, 0.0], residual_u=residual_u, drafts=drafts, q=q)
        assert result == VerifyResult(0, [sample_from_probs(P[0], residual_u)])


def test_untrusted_second_row_keeps_the_first_draft():
    q = torch.tensor([[0.8, 0.2], [math.nan, 0.75]], dtype=torch.float64)
    assert run([0.1, 0.0], residual_u=0.65, q=q) == VerifyResult(1, [1, sample_from_probs(P[1], 0.65)])


def test_keyed_uniforms():
    seed, s = 1234, 57
    keyed = verify_sampled_keyed(DRAFTS, CANDS, Q, P, seed, s)
    explicit = run([uniform(seed, s, Purpose.ACCEPT, 1), uniform(seed, s, Purpose.ACCEPT, 2)],
                   uniform(seed, s, Purpose.RESIDUAL, 0), uniform(seed, s, Purpose.BONUS, 0))
    assert keyed == explicit
    outcomes = {tuple(verify_sampled_keyed(DRAFTS, CANDS, Q, P, seed, s).emitted) for s in range(200)}
    assert {(1, 0, 2), (0,), (2,), (3,)} <= outcomes


def test_fp32_inputs():
    assert run([0.4999, 0.999], q=Q.float(), p=P.float()) == VerifyResult(2, [1, 0, 2])


def test_no_drafts_is_a_bonus_draw():
    empty = torch.zeros(0, 2)
    result = verify_sampled(torch.tensor([], dtype=torch.long), empty.long(), empty, P[:1], [], 0.5, 0.35)
    assert result == VerifyResult(0, [sample_from_probs(P[0], 0.35)])


@pytest.mark.parametrize("change,match", [
    (dict(p=P[:2]), "target_probs"), (dict(q=Q[:, :1]), "draft_probs"), (dict(accept_u=[0.5]), "accept_u"),
    (dict(cands=CANDS + 3), "cand_ids"), (dict(accept_u=[1.0, 0.5]), r"accept_u\[0\]"),
    (dict(residual_u=-0.1), "residual_u"), (dict(drafts=torch.tensor([1, 9])), "draft_tokens"),
])
def test_refused_inputs(change, match):
    kwargs = dict(accept_u=[0.1, 0.1]) | change
    with pytest.raises(ValueError, match=match):
        run(**kwargs)
