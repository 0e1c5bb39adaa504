"""MTP as a Proposer: k chained steps of the target's own multi-token-prediction head.

The MTP head reads pairs (h_p, t_{p+1}) at position p (``reference/model/mtp.py``). With the anchor
t0 at position s and the target's hidden h_{s-1} (the row that predicted t0):

    step 1: (h_{s-1}, t0) at s-1 -> y_1 = argmax(logits)         committed pair: stays cached
    step j: (m_{j-1}, y_{j-1}) at s+j-2 -> y_j                    m = the MTP's own output hidden

The drafts are argmax picks, so each slot's q is one-hot (K = 1); the sparse-q verifier then
accepts y_j with probability p_j(y_j) when sampling, which keeps the target's law exactly.
After a verify, the chained entries (positions >= s) are dropped and replaced by the pairs of
the target's own hidden states for the accepted rows; the hidden of the last committed row
waits for the next anchor token. An observe that finds the pair (h_{s-1}, t_s) missing (no
propose ran since the last observe: a prefill chunk after the first, or a final step with no
drafts) adds it first, so at every frontier f the cache holds pairs 0 .. f-2 exactly.

Prefix cache: a snapshot at f is that cache and h_{f-1} (:class:`MTPState`); a restore clones them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..model.mtp import MTPCache, ReferenceMTP, greedy_chain
from .proposer import Proposal, Proposer
from ..request.sampling_params import SamplingParams
from ..model.target import TargetOutput


@dataclass(frozen=True)
class MTPState:
    """An MTP snapshot at frontier f: the MTP cache of pairs 0 .. f-2 and h_{f-1}, which pairs with t_f."""

    cache: MTPCache  # length f-1
    pending_hidden: Tensor  # [C]


class MTPProposer(Proposer):
    def __init__(self, mtp: ReferenceMTP):
        self.mtp = mtp
        self.cache = mtp.new_cache()
        self.pending_hidden: torch.Tensor | None = None  # [C] h of the last committed row

    def observe(self, tokens: Sequence[int], first_position: int, target_out: TargetOutput,
                num_committed: int) -> None:
        self.cache.truncate(first_position)  # drop the chained draft pairs at positions >= s
        # pairs (h_p, t_{p+1}) whose next token is committed, at p = s .. s+num_committed-2
        hidden, next_ids = target_out.hidden[:num_committed - 1], list(tokens[1:num_committed])  # [n, C], [n]
        if self.cache.length == first_position - 1:  # no propose cached (h_{s-1}, t_s): it goes first
            hidden = torch.cat([self.pending_hidden[None], hidden])
            next_ids = [tokens[0]] + next_ids
        if next_ids:
            self.mtp.forward(hidden, torch.tensor(next_ids), self.cache)
        self.pending_hidden = target_out.hidden[num_committed - 1]

    def propose(self, anchor_token: int, anchor_position: int, k: int, params: SamplingParams) -> Proposal:
        assert self.cache.length == anchor_position - 1, "the MTP cache must end at the anchor's predecessor"
        return Proposal.deterministic(greedy_chain(self.mtp, self.pending_hidden, anchor_token, self.cache, k))

    def snapshot(self, frontier: int) -> MTPState:
        assert self.cache.length == frontier - 1, "at frontier f the MTP cache holds pairs 0 .. f-2"
        return MTPState(self.cache.clone(), self.pending_hidden.clone())

    def restore(self, state: object) -> None:
        if not isinstance(state, MTPState):
            raise ValueError(f"an MTP restore needs an MTPState, got {type(state).__name__} (a snapshot taken by "
                             "another kind of proposer?)")
        self.cache, self.pending_hidden = state.cache.clone(), state.pending_hidden.clone()
