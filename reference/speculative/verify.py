"""Verification of k drafted tokens against the target: greedy prefix match and sparse-q rejection.

The target ran over [t0, y_1..y_k] at positions s..s+k; its row i-1 predicts slot i (position
s+i), so row i-1 gives p_i and row k gives p_{k+1}. The result keeps num_accepted = a drafts and
emits num_emitted = a + 1 tokens: y_1..y_a, then a correction for slot a+1 (a < k) or a bonus
token for slot k+1 (a = k).

Greedy. a = the longest prefix with y_i = argmax(logits row i-1) (ties to the lowest id); the
last emitted token is argmax(row a). Every emitted token is then what plain greedy decoding would
have produced from the same prefix.

Sampled (sparse-q rejection). Slot i's draft distribution q_i is given on its candidates:
``cand_ids [K]`` with ``draft_probs [K]``; on the vocabulary q_i = scatter-add of draft_probs / total
over cand_ids (``total`` = their sum; a proposer drew from the normalised row). For i = 1..k:

    accept y_i  iff  accept_u_i * q_i(y_i) < p_i(y_i)              (probability min(1, p/q))

at the first rejection i* the token is the inverse-CDF draw ``sample_from_probs(r, residual_u)`` from

    r = max(0, p_{i*} - q_{i*}) / sum(max(0, p_{i*} - q_{i*}))     (p_{i*} itself if that sum is 0)

and after k acceptances a bonus ``sample_from_probs(p_{k+1}, bonus_u)``. All of this runs in
float64 (fp32 inputs convert exactly).

Why the committed token at slot i follows p_i exactly when y ~ q (sums over the vocabulary):
P(accept and x) = q(x) min(1, p(x)/q(x)) = min(p(x), q(x)); P(reject) = sum_y (q(y) - min(p, q)(y))
= 1 - sum min(p, q) = sum_x max(0, p(x) - q(x)) =: m; so P(x) = min(p, q)(x) + m * max(0, p(x) - q(x))
/ m = p(x). If m = 0 then p = q, a rejection has probability 0 and the fallback to p never
matters. By induction over slots (an accepted y_i is the committed prefix the next p and q are
conditioned on) the committed sequence follows the target's autoregressive law.

One-hot q (K = 1: MTP, n-gram and argmax proposers): q(y) = 1, so y is accepted with probability
p(y), and r = p with y removed, renormalised.

Untrusted rows. A q row that is NaN or infinite anywhere, has a negative entry, sums to 0, or
gives y_i no mass (y_i not among cand_ids, or its entry is 0) is untrusted: slot i is rejected
without looking at accept_u_i and the token is ``sample_from_probs(p_i, residual_u)``. A finite,
non-negative row with a positive total other than 1 is trusted and divided by its total first:
the proposer drew from the normalised row, and the raw row c*q would accept with min(1, p/(c q)).

Proof that slot i still commits a token with law p_i. Fix the prefix and the reported row R
(they are determined before slot i's uniforms are drawn) and let S = {y : q_R(y) > 0}, empty if R
is bad. (a) y_i not in S: the slot is untrusted, and the token is an inverse-CDF draw from p_i
with residual_u, a uniform independent of the prefix, R, y_i and accept_u, and used by no other
draw of the step: its law is exactly p_i, whatever produced y_i. (b) y_i in S: the argument above
applies to the normalised row, given that the proposer is faithful on S (conditioned on y_i in
S, y_i ~ q_R; a proposer that drew y_i ~ q_R always is). Both conditional laws are p_i, so their
mixture is p_i for any probability of landing in S. NaN rows, rows with y outside and a
proposer's fallbacks on bad rows therefore cost acceptance, never exactness.

Keyed uniforms (``verify_sampled_keyed``, seed of the request, anchor position s):
accept_u_i = rng.uniform(seed, s, ACCEPT, i) for i = 1..k; residual_u = uniform(seed, s,
RESIDUAL, 0); bonus_u = uniform(seed, s, BONUS, 0). One step uses each key once; the anchor
position is strictly increasing over a request's steps, so no key is reused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..request.rng import Purpose, uniform
from .sampling import greedy_token, sample_from_probs


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int  # drafts kept, 0..k
    emitted: list[int]  # y_1..y_a then the correction or bonus token: num_accepted + 1 ids

    @property
    def num_emitted(self) -> int:
        return len(self.emitted)


def verify_greedy(draft_tokens: Tensor, target_logits: Tensor) -> VerifyResult:
    """Greedy prefix match  # draft_tokens [k], target_logits [k+1, V]."""
    drafts = torch.as_tensor(draft_tokens).tolist()
    if target_logits.dim() != 2 or target_logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"target_logits {list(target_logits.shape)}: expected [{len(drafts) + 1}, V]")
    emitted = []
    for i, y in enumerate(drafts):  # row i predicts slot i+1
        best = greedy_token(target_logits[i])
        emitted.append(best)
        if y != best:
            return VerifyResult(i, emitted)
    emitted.append(greedy_token(target_logits[len(drafts)]))
    return VerifyResult(len(drafts), emitted)


def draft_row_on_vocab(cand_ids: Tensor, draft_probs: Tensor, token: int, vocab_size: int) -> Tensor | None:
    """q over the vocabulary, normalised by its total, or None if untrusted  # [K], [K] -> [V] float64."""
    q = draft_probs.double()
    total = float(q.sum())
    # NaN fails q >= 0, an infinite entry makes the total infinite
    if not (0.0 < total < math.inf and bool((q >= 0).all())):
        return None
    q_vocab = torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, cand_ids, q / total)
    return q_vocab if float(q_vocab[token]) > 0.0 else None


def accepts(u: float, q_token: float, p_token: float) -> bool:
    """The acceptance test u * q(y) < p(y): true with probability min(1, p(y) / q(y)) for u ~ U(0, 1)."""
    return u * q_token < p_token


def residual_probs(p: Tensor, q_vocab: Tensor) -> Tensor:
    """r = max(0, p - q) normalised, or p where that has no mass  # [V], [V] -> [V] float64."""
    r = (p - q_vocab).clamp_min(0.0)
    mass = float(r.sum())
    return r / mass if mass > 0.0 else p


def _check_sampled_inputs(drafts: list[int], cand_ids: Tensor, draft_probs: Tensor, target_probs: Tensor,
                          uniforms: list[tuple[str, float]]) -> None:
    k = len(drafts)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs {list(target_probs.shape)}: expected [{k + 1}, V]")
    vocab_size = target_probs.shape[1]
    if cand_ids.dim() != 2 or cand_ids.shape[0] != k or tuple(draft_probs.shape) != tuple(cand_ids.shape):
        raise ValueError(f"cand_ids {list(cand_ids.shape)} and draft_probs {list(draft_probs.shape)}: "
                         f"expected both [{k}, K]")
    if len(uniforms) != k + 2:
        raise ValueError(f"accept_u has {len(uniforms) - 2} uniforms, expected {k}")
    if cand_ids.numel() and not (0 <= int(cand_ids.min()) and int(cand_ids.max()) < vocab_size):
        raise ValueError(f"cand_ids outside 0 .. {vocab_size - 1}")
    if drafts and not (0 <= min(drafts) and max(drafts) < vocab_size):
        raise ValueError(f"draft_tokens {drafts} outside 0 .. {vocab_size - 1}")
    for name, u in uniforms:
        if not 0.0 <= u < 1.0:
            raise ValueError(f"{name}={u!r}: expected a uniform in [0, 1)")


def verify_sampled(draft_tokens: Tensor, cand_ids: Tensor, draft_probs: Tensor, target_probs: Tensor,
                   accept_u: Sequence[float] | Tensor, residual_u: float, bonus_u: float) -> VerifyResult:
    """Sparse-q rejection with explicit uniforms (see the module docstring).

    draft_tokens [k] long, cand_ids [k, K] long, draft_probs [k, K], target_probs [k+1, V]
    (filtered target distributions, rows summing to 1), accept_u [k] in [0, 1).
    """
    drafts = torch.as_tensor(draft_tokens).tolist()
    cand_ids = torch.as_tensor(cand_ids, dtype=torch.long)
    accept_u = accept_u.tolist() if isinstance(accept_u, Tensor) else [float(u) for u in accept_u]
    _check_sampled_inputs(drafts, cand_ids, draft_probs, target_probs,
                          [(f"accept_u[{i}]", u) for i, u in enumerate(accept_u)]
                          + [("residual_u", residual_u), ("bonus_u", bonus_u)])
    target_probs, draft_probs = target_probs.double(), draft_probs.double()  # [k+1, V], [k, K]
    vocab_size = target_probs.shape[1]

    for i, y in enumerate(drafts):  # slot i+1: target row i, draft row i
        p = target_probs[i]  # [V]
        q_vocab = draft_row_on_vocab(cand_ids[i], draft_probs[i], y, vocab_size)
        if q_vocab is None:  # untrusted: an exact draw from p
            return VerifyResult(i, drafts[:i] + [sample_from_probs(p, residual_u)])
        if not accepts(accept_u[i], float(q_vocab[y]), float(p[y])):
            return VerifyResult(i, drafts[:i] + [sample_from_probs(residual_probs(p, q_vocab), residual_u)])
    return VerifyResult(len(drafts), drafts + [sample_from_probs(target_probs[-1], bonus_u)])


def verify_sampled_keyed(draft_tokens: Tensor, cand_ids: Tensor, draft_probs: Tensor, target_probs: Tensor,
                         seed: int, anchor_position: int) -> VerifyResult:
    """``verify_sampled`` with the uniforms keyed by (seed, anchor position s, purpose, slot)."""
    k = len(torch.as_tensor(draft_tokens))
    accept_u = [uniform(seed, anchor_position, Purpose.ACCEPT, i) for i in range(1, k + 1)]
    return verify_sampled(draft_tokens, cand_ids, draft_probs, target_probs, accept_u,
                          uniform(seed, anchor_position, Purpose.RESIDUAL, 0),
                          uniform(seed, anchor_position, Purpose.BONUS, 0))
