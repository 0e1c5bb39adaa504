"""MTP as a Proposer: k chained steps of the target's own multi-token-prediction head.

The MTP head reads pairs (h_p, t_{p+1}) at position p (``reference/model/mtp.py``). With the anchor
t0 at position s and the target's hidden h_{s-1} (the row that predicted t0):

    step 1: (h_{s-1}, t0) at s-1 -> y_1 = argmax(logits)         committed pair: stays cached
    step j: (m_{j-1}, y_{j-1}) at s+j-2 -> y_j                    m = the MTP's own output hidden

The drafts are argmax picks, so each slot's q is one-hot (K = 1); the sparse-q verifier then
accepts y_j with probability p_j(y_j) when sampling, which keeps the target's law exactly.
After a verify, the chained entries (positions >= s) are dropped and replaced by the pairs of
the target's own hidden states for the accepted rows; the hidden of the last committed row
waits for the next anchor token.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..model.mtp import ReferenceMTP, greedy_chain
from .proposer import Proposal, Proposer
from ..request.sampling_params import SamplingParams
from ..model.target import TargetOutput


class MTPProposer(Proposer):
    def __init__(self, mtp: ReferenceMTP):
        self.mtp = mtp
        self.cache = mtp.new_cache()
        self.pending_hidden: torch.Tensor | None = None  # [C] h of the last committed row

    def observe(self, tokens: Sequence[int], first_position: int, target_out: TargetOutput,
                num_committed: int) -> None:
        self.cache.truncate(first_position)  # drop the chained draft pairs at positions >= s
        if num_committed > 1:  # pairs (h_p, t_{p+1}) whose next token is committed
            next_ids = torch.tensor(list(tokens[1:num_committed]))
            self.mtp.forward(target_out.hidden[:num_committed - 1], next_ids, self.cache)
        self.pending_hidden = target_out.hidden[num_committed - 1]

    def propose(self, anchor_token: int, anchor_position: int, k: int, params: SamplingParams) -> Proposal:
        assert self.cache.length == anchor_position - 1, "the MTP cache must end at the anchor's predecessor"
        return Proposal.deterministic(greedy_chain(self.mtp, self.pending_hidden, anchor_token, self.cache, k))
