"""Verification of a batch's drafts against the target (twin of ``reference/speculative/verify.py``).

Requests may draft different k (a request near its max_tokens verifies fewer drafts, exactly as it would
alone): :func:`verify_ragged` groups them by k (one group in steady state) and runs the keyed verify kernel
(``fast/kernels/sampling/rejection.verify``: the greedy prefix match, or sparse-q rejection with uniforms keyed
(seed, s, ACCEPT, i), (seed, s, RESIDUAL, 0), (seed, s, BONUS, 0) at the anchor s). A request with k = 0 (one
token left) emits its bonus token: the draw from p with (seed, s, BONUS, 0), argmax when greedy.

A speculative step calls its verifier through the :class:`Verifier` signature; the engine's is
:func:`verify_ragged` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose

from ..kernels.sampling.rejection import verify
from ..kernels.sampling.sampler import SamplingTensors, sample
from .proposer import DraftProposal


@dataclass(frozen=True)
class VerifyOutput:
    num_accepted: Tensor  # [B] long, 0..k_b
    emitted: Tensor  # [B, R] long: request b's first num_accepted + 1 entries are its committed tokens


class Verifier(Protocol):
    def __call__(self, logits: Tensor, proposal: DraftProposal, ks: Sequence[int], st: SamplingTensors,
                 anchor_positions: Tensor) -> VerifyOutput:
        """logits ``[B, R, V]`` (request b's row i predicts its slot i+1), the proposal, k_b per request."""


def verify_ragged(logits: Tensor, proposal: DraftProposal, ks: Sequence[int], st: SamplingTensors,
                  anchor_positions: Tensor) -> VerifyOutput:
    """logits [B, R, V] (request b's row i predicts its slot i+1; rows past k_b unused), the proposal's
    tokens [B, R-1] and cand_ids / draft_probs [B, R-1, K], ks: k_b <= R-1 per request (host ints)."""
    draft_tokens, cand_ids, draft_probs = proposal.tokens, proposal.cand_ids, proposal.draft_probs
    batch, rows = logits.shape[:2]
    device = logits.device
    if ks and set(ks) == {rows - 1} and rows > 1:  # every request verifies all its rows: one
        # call, its outputs as they are (a captured step's usual case: no fills or copies around it)
        return VerifyOutput(*verify(logits, st, draft_tokens, cand_ids, draft_probs, anchor_positions))
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    emitted = torch.full((batch, rows), -1, dtype=torch.long, device=device)
    for k in sorted(set(ks)):
        members = [b for b, kb in enumerate(ks) if kb == k]
        if len(members) == batch:
            index = slice(None)
        else:
            index = torch.tensor(members, dtype=torch.long, device=device)
        group_st = st if len(members) == batch else st.select(index)
        if k == 0:
            emitted[index, 0] = sample(logits[index, 0], group_st, anchor_positions[index], Purpose.BONUS, 0)
            continue
        accepted, tokens = verify(logits[index, :k + 1], group_st, draft_tokens[index, :k],
                                  cand_ids[index, :k], draft_probs[index, :k], anchor_positions[index])
        num_accepted[index] = accepted
        emitted[index, :k + 1] = tokens
    return VerifyOutput(num_accepted, emitted)
