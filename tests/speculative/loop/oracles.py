"""Proposers that know the answer, to drive every path of the verifier through the real loop.

``ScriptedProposer`` proposes a fixed continuation (the plain greedy output) with chosen slots
corrupted, so acceptance, correction, bonus and GDN rollback all happen at known places.
``NoisyTargetProposer`` samples its drafts from a sparse distribution q that is the target's own p
flattened and cut to its top candidates: close to p but not equal, so sampled verifies accept,
reject and resample.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash2.reference.speculative.proposer import Proposal, Proposer
from dflash2.reference.request.rng import Purpose, uniform
from dflash2.reference.speculative.sampling import sample_from_probs, target_probs
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.model.target import ReferenceTarget


class ScriptedProposer(Proposer):
    def __init__(self, script: Sequence[int], corrupt: set[tuple[int, int]], vocab_size: int):
        self.script, self.corrupt, self.vocab_size = list(script), corrupt, vocab_size
        self.proposed: list[tuple[int, list[int]]] = []

    def observe(self, tokens, first_position, target_out, num_committed) -> None:
        pass

    def propose(self, anchor_token: int, anchor_position: int, k: int, params: SamplingParams) -> Proposal:
        drafts = list(self.script[anchor_position + 1:anchor_position + 1 + k])
        drafts = [(t + 1) % self.vocab_size if (anchor_position, i + 1) in self.corrupt else t
                  for i, t in enumerate(drafts)]
        self.proposed.append((anchor_position, drafts))
        return Proposal.deterministic(drafts)


class NoisyTargetProposer(Proposer):
    def __init__(self, target: ReferenceTarget, num_candidates: int = 3, flatten: float = 0.5):
        self.target, self.num_candidates, self.flatten = target, num_candidates, flatten
        self.history: list[int] = []

    def observe(self, tokens, first_position, target_out, num_committed) -> None:
        del self.history[first_position:]
        self.history += list(tokens[:num_committed])

    def propose(self, anchor_token: int, anchor_position: int, k: int, params: SamplingParams) -> Proposal:
        prefix = self.history[:anchor_position] + [anchor_token]
        tokens, cands, probs = [], [], []
        for i in range(1, k + 1):
            logits = self.target.forward(torch.tensor(prefix)).logits[-1]
            p = target_probs(logits, SamplingParams(temperature=1.0))
            ids = torch.sort(-p, stable=True).indices[:self.num_candidates]
            q = p[ids] ** self.flatten
            q = q / q.sum()
            pick = sample_from_probs(q, uniform(params.seed, anchor_position, Purpose.SELECTOR, i))
            tokens.append(int(ids[pick]))
            cands.append(ids)
            probs.append(q)
            prefix.append(tokens[-1])
        return Proposal(torch.tensor(tokens), torch.stack(cands), torch.stack(probs).float())
