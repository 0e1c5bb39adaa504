"""What a batched proposer returns: k drafts per request and the sparse q each was drawn from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftProposal:
    """Twin of ``reference/proposer.Proposal`` for B requests (rows sum to 1; K is the same for all)."""

    tokens: Tensor  # [B, k] long: y_1..y_k
    cand_ids: Tensor  # [B, k, K] long: the support of q_i (DFlash: K = K_sel)
    draft_probs: Tensor  # [B, k, K] fp32: q_i over cand_ids (greedy or argmax picks: one-hot)

    @staticmethod
    def deterministic(tokens: Tensor) -> DraftProposal:
        """Every slot picked with certainty: K = 1, q = 1  # tokens [B, k]."""
        return DraftProposal(tokens, tokens[..., None].clone(), torch.ones(*tokens.shape, 1, device=tokens.device))
