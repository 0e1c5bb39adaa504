"""The ``--trace`` record of one verify step: one format for both engines, so their traces compare."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One verify step of one request (``anchor_position`` s, drafts for s+1..s+k)."""

    anchor_position: int
    draft_tokens: list[int]
    cand_ids: list[list[int]]  # [k][K]: the support of each slot's q
    draft_probs: list[list[float]]  # [k][K]: q over cand_ids
    target_tokens: list[int]  # the target's argmax at each verified row (k + 1)
    num_accepted: int
    emitted: list[int]  # num_accepted + 1 tokens

    def to_json(self) -> dict:
        return dict(anchor_position=self.anchor_position, draft_tokens=self.draft_tokens, cand_ids=self.cand_ids,
                    q=self.draft_probs, target_tokens=self.target_tokens, num_accepted=self.num_accepted,
                    emitted=self.emitted)
