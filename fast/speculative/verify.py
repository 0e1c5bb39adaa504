"""Verification of a batch's drafts against the target (twin of ``reference/speculative/verify.py``).

Requests may draft different k (a request near its max_tokens verifies fewer drafts, exactly as it would
alone): :func:`verify_ragged` runs the keyed verify kernel once over the batch's largest k with each request's
own k_b as its limit (``fast/kernels/sampling/rejection.verify``: the greedy prefix match, or sparse-q rejection
with uniforms keyed (seed, s, ACCEPT, i), (seed, s, RESIDUAL, 0), (seed, s, BONUS, 0) at the anchor s). A request
with k_b = 0 (one token left) emits its bonus token: the draw from p with (seed, s, BONUS, 0), argmax when greedy.

A speculative step calls its verifier through the :class:`Verifier` signature; the engine's is
:func:`verify_ragged` itself. ``ks`` is host ints (the eager step) or a device tensor (a captured step's draft
limits, ``engine/step_buffers.StepFields.draft_limits``).
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
    def __call__(self, logits: Tensor, proposal: DraftProposal, ks: Sequence[int] | Tensor, st: SamplingTensors,
                 anchor_positions: Tensor) -> VerifyOutput:
        """logits ``[B, R, V]`` (request b's row i predicts its slot i+1), the proposal, k_b per request."""


def verify_ragged(logits: Tensor, proposal: DraftProposal, ks: Sequence[int] | Tensor, st: SamplingTensors,
                  anchor_positions: Tensor) -> VerifyOutput:
    """logits [B, R, V] (request b's row i predicts its slot i+1; rows past k_b unused), the proposal's
    tokens [B, R-1] and cand_ids / draft_probs [B, R-1, K], ks: k_b <= R-1 per request (host ints, or a
    device tensor [B])."""
    rows = logits.shape[1]
    args = (proposal.tokens, proposal.cand_ids, proposal.draft_probs, anchor_positions)
    if isinstance(ks, Tensor):  # a captured step: its limits live on the device
        if rows == 1:
            return _bonus_only(logits, st, anchor_positions)
        return VerifyOutput(*verify(logits, st, *args, ks))
    if not ks or max(ks) == 0:  # no drafts at all
        return _bonus_only(logits, st, anchor_positions)
    if min(ks) == rows - 1:  # every request verifies all its rows: its outputs as they are
        return VerifyOutput(*verify(logits, st, *args))
    limits = torch.tensor(list(ks), dtype=torch.long, device=logits.device)
    num_accepted, emitted = verify(logits, st, *args, limits)
    return VerifyOutput(num_accepted, emitted)


def _bonus_only(logits: Tensor, st: SamplingTensors, anchor_positions: Tensor) -> VerifyOutput:
    """A step of no drafts: each request's bonus token from row 0 (the draw keyed (seed, s, BONUS, 0))."""
    emitted = torch.full(logits.shape[:2], -1, dtype=torch.long, device=logits.device)
    emitted[:, 0] = sample(logits[:, 0], st, anchor_positions, Purpose.BONUS, 0)
    return VerifyOutput(torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device), emitted)
