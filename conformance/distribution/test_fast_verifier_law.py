"""DISTRIBUTION: the fast verifier (torch and Triton) keeps the target's law, measured by sampling.

N independent requests (distinct seeds) each draft y_1 ~ q_1, y_2 ~ q_2 from sparse q rows
(K = 3 candidates, q different from p) and go through one batched fast verify over
target logits log p. Two laws are compared with their analytic values, every bin within
5 standard errors:

- the first committed token: exactly p_1 (the sparse-q rejection theorem);
- the number of accepted drafts a: P(a=0) = 1 - A_1, P(a=1) = A_1 (1 - A_2), P(a=2) = A_1 A_2
  with A_i = sum_x min(p_i(x), q_i(x)) (p_2 does not depend on y_1 in this toy).

A planted bug (q rows reported flattened, so the verifier's q is not what the drafts were drawn
from) must break the first law.
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.fast.kernels.sampling.rejection import verify_torch, verify_triton
from dflash2.fast.kernels.sampling.sampler import SamplingTensors
from dflash2.reference.request.sampling_params import SamplingParams

V, K = 6, 3
P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                  [0.05, 0.40, 0.05, 0.20, 0.10, 0.20],
                  [0.10, 0.10, 0.20, 0.20, 0.20, 0.20]], dtype=torch.float64)  # p_1, p_2, p_3 (bonus)
CANDS = torch.tensor([[0, 1, 5], [1, 3, 4]])  # the support of q_1 (with a token p cannot produce), q_2
Q = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]], dtype=torch.float64)


def draw_requests(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.multinomial(Q[i].float(), n, replacement=True, generator=gen) for i in range(2)], 1)
    drafts = CANDS[torch.arange(2), picks]  # [n, 2]
    cand_ids = CANDS.expand(n, 2, K).contiguous()
    draft_probs = Q.float().expand(n, 2, K).contiguous()
    logits = torch.log(P.float()).expand(n, 3, V).contiguous()  # -inf where p = 0
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(1, n + 1)]
    return logits, SamplingTensors.from_params(params), drafts, cand_ids, draft_probs, torch.full((n,), 7)


def _to(st: SamplingTensors, device: str) -> SamplingTensors:
    return SamplingTensors(*(t.to(device) for t in (st.temperature, st.top_k, st.top_p, st.seeds)))


def within(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    """The largest deviation in standard errors over bins (inf for mass where the law has none)."""
    worst = 0.0
    for c, p in zip(counts.tolist(), probs.tolist()):
        if p == 0.0:
            if c:
                return math.inf
            continue
        worst = max(worst, abs(c / n - p) / math.sqrt(p * (1 - p) / n))
    return worst


def accept_mass(i: int) -> float:
    q_vocab = torch.zeros(V, dtype=torch.float64).index_add_(0, CANDS[i], Q[i])
    return float(torch.minimum(P[i], q_vocab).sum())


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Triton runs in its interpreter without a GPU (about 50 ms a request): few rows there, the full law
# on CUDA; that the two implementations agree bit for bit is conformance/ops/test_rejection.py's job
VERIFIERS = [pytest.param(verify_torch, 100_000, id="torch"),
             pytest.param(verify_triton, 100_000 if CUDA else 200, id="triton")]


@pytest.mark.parametrize("verify,n", VERIFIERS)
def test_first_committed_token_and_accepted_count_follow_the_law(verify, n):
    logits, st, drafts, cand_ids, draft_probs, anchors = draw_requests(n)
    num_accepted, emitted = verify(logits.to(DEVICE), _to(st, DEVICE), drafts.to(DEVICE), cand_ids.to(DEVICE),
                                   draft_probs.to(DEVICE), anchors.to(DEVICE))
    num_accepted, emitted = num_accepted.cpu(), emitted.cpu()
    first = torch.bincount(emitted[:, 0], minlength=V).double()
    assert within(first, P[0], n) < 5.0
    a1, a2 = accept_mass(0), accept_mass(1)
    accepted = torch.bincount(num_accepted, minlength=3).double()
    assert within(accepted, torch.tensor([1 - a1, a1 * (1 - a2), a1 * a2]), n) < 5.0


def test_planted_bug_misreported_q_breaks_the_law():
    n = 100_000
    logits, st, drafts, cand_ids, draft_probs, anchors = draw_requests(n)
    flattened = torch.full_like(draft_probs, 1.0 / K)
    _, emitted = verify_torch(logits, st, drafts, cand_ids, flattened, anchors)
    assert within(torch.bincount(emitted[:, 0], minlength=V).double(), P[0], n) > 5.0
