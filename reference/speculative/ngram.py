"""A prompt-lookup n-gram proposer: the worked example of ``docs/writing-a-proposer.md``.

Drafting without a model: find the most recent earlier occurrence of the last n committed tokens
(n from ``max_ngram`` down to ``min_ngram``) and propose the (up to k) tokens that followed it.
Picks are deterministic, so every slot's q is one-hot (K = 1) and the sparse-q verifier keeps
the target's law exactly. With no match it proposes nothing and the verify emits one token.
"""

from __future__ import annotations

from typing import Sequence

from .proposer import Proposal, Proposer
from ..request.sampling_params import SamplingParams
from ..model.target import TargetOutput


class NgramProposer(Proposer):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: expected 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []  # committed tokens by position (the anchor excluded)

    def observe(self, tokens: Sequence[int], first_position: int, target_out: TargetOutput,
                num_committed: int) -> None:
        del self.history[first_position:]  # rows past the frontier were rejected
        self.history += list(tokens[:num_committed])

    def propose(self, anchor_token: int, anchor_position: int, k: int, params: SamplingParams) -> Proposal:
        context = self.history[:anchor_position] + [anchor_token]
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            # the latest earlier start whose n tokens equal the suffix
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + k]
                    return Proposal.deterministic(follow)
        return Proposal.deterministic([])

    def snapshot(self, frontier: int) -> tuple[int, ...]:
        return tuple(self.history[:frontier])  # the committed tokens 0 .. f-1

    def restore(self, state: object) -> None:
        self.history = list(state)
