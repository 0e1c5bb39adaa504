"""The Proposer interface: committed state in; draft tokens, candidates and q out.

Every speculative method (DFlash 2, MTP, a prompt-lookup n-gram, yours) is a Proposer. The
speculative loop (``reference/speculative/loop.py``) drives it the same way for all of them:

1. ``observe(tokens, first_position, target_out, num_committed)`` after every target forward
   (the prefill over the prompt, or each of its chunks, and each verify over ``[t0, y_1..y_k]``).
   The forward's rows cover positions ``first_position ..``; only the first ``num_committed`` are
   committed. The rest were rejected: a proposer may have written state for them (the DFlash ring
   does, before acceptance is known) but must never read it, because the next anchor lies before
   them.
2. ``propose(anchor_token, anchor_position, k, params)``: the last committed token ``t0`` sits
   at ``anchor_position`` s and has not been through the target yet. Return k draft tokens
   ``y_1..y_k`` for positions s+1..s+k, and for each slot the sparse draft distribution q_i the
   token was drawn from: ``cand_ids [k, K]`` and ``draft_probs [k, K]``. A proposer that picks
   deterministically (argmax, a lookup) returns K = 1 with probability 1: the sparse-q verifier
   then accepts y_i with probability p_i(y_i) and keeps the target's law exactly.
3. ``snapshot(f)`` and ``restore(state)``, for the prefix cache (``reference/speculative/prefix.py``):
   at a frontier f (rows < f committed, the anchor at f), ``snapshot`` returns the per-request
   state a later request with the same first f tokens needs; ``restore`` makes a proposer hold
   exactly that, so its next proposal after the same observes equals, bit for bit, the one a
   proposer that ran through the whole prefix would make. The default keeps nothing (a proposer
   with no per-request state).

Randomness a proposer uses must come from ``rng.uniform(params.seed, anchor_position,
Purpose.SELECTOR, i)`` for slot i, so runs are reproducible and engines comparable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from ..request.sampling_params import SamplingParams
from ..model.target import TargetOutput


@dataclass(frozen=True)
class Proposal:
    """k drafted tokens and the sparse distribution each was drawn from."""

    tokens: torch.Tensor  # [k] long: y_1..y_k
    cand_ids: torch.Tensor  # [k, K] long: the support of q_i
    draft_probs: torch.Tensor  # [k, K] fp32: q_i over cand_ids (rows sum to 1)

    @staticmethod
    def deterministic(tokens: Sequence[int]) -> "Proposal":
        """A proposal whose every slot was picked with certainty (q one-hot, K = 1)."""
        ids = torch.tensor(list(tokens), dtype=torch.long)
        return Proposal(ids, ids[:, None].clone(), torch.ones(len(ids), 1))

    def q_of_drafted(self) -> list[float]:
        """q_i(y_i) for each slot (0 when y_i is not among the candidates)."""
        hit = self.cand_ids == self.tokens[:, None]
        return (self.draft_probs * hit).sum(-1).tolist()


class Proposer(ABC):
    """What the speculative loop needs from a drafting method (see the module docstring)."""

    @abstractmethod
    def observe(self, tokens: Sequence[int], first_position: int, target_out: TargetOutput,
                num_committed: int) -> None:
        """The target ran over ``tokens`` at ``first_position..``; the first ``num_committed`` are committed."""

    @abstractmethod
    def propose(self, anchor_token: int, anchor_position: int, k: int, params: SamplingParams) -> Proposal:
        """Draft k tokens after the committed anchor token at ``anchor_position``."""

    def snapshot(self, frontier: int) -> object:
        """The state a restore at ``frontier`` f needs (every row < f committed). Default: nothing."""
        return None

    def restore(self, state: object) -> None:
        """Forget this request's state and hold what ``snapshot`` returned; the next observe starts at f."""
