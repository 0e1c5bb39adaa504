"""A drafting method that peeks at the target, so verify steps accept, reject, correct and add bonus
tokens at many places (random tiny drafts accept almost nothing). Two faces of one oracle:
``PeekingProposer`` for the reference loop and ``PeekingDrafter`` for the fast engine; both
draft the same tokens with the same q for the same committed prefix.

For slot i = 1..k after the prefix (anchor at s): p = softmax(target logits) at temperature 1,
the three most likely tokens are the candidates and q = p^0.5 over them, renormalised. A greedy
request takes the most likely candidate, except the second one where (s + i) % 4 == 0 (so some
drafts are wrong), with q one-hot; a sampled one draws from q with uniform(seed, s, SELECTOR, i).
"""

from __future__ import annotations

import torch

from dflash2.fast.speculative.proposer import DraftProposal
from dflash2.reference.speculative.proposer import Proposal, Proposer
from dflash2.reference.request.rng import Purpose, uniform
from dflash2.reference.speculative.sampling import sample_from_probs
from dflash2.reference.model.target import ReferenceTarget

NUM_CANDIDATES = 3


def peek(target: ReferenceTarget, prefix: list[int], s: int, k: int, greedy: bool, seed: int):
    """(tokens [k], cand_ids [k, 3], q [k, 3]) drafted after ``prefix`` (its last token at s)."""
    prefix = list(prefix)
    tokens, cands, probs = [], [], []
    for i in range(1, k + 1):
        p = torch.softmax(target.forward(torch.tensor(prefix)).logits[-1], dim=-1)
        ids = torch.sort(-p, stable=True).indices[:NUM_CANDIDATES]
        q = p[ids] ** 0.5
        q = q / q.sum()
        if greedy:
            pick = 1 if (s + i) % 4 == 0 else 0
            q = torch.zeros(NUM_CANDIDATES)
            q[pick] = 1.0
        else:
            pick = sample_from_probs(q, uniform(seed, s, Purpose.SELECTOR, i))
        tokens.append(int(ids[pick]))
        cands.append(ids)
        probs.append(q.float())
        prefix.append(tokens[-1])
    return tokens, torch.stack(cands), torch.stack(probs)


class PeekingProposer(Proposer):
    def __init__(self, target: ReferenceTarget):
        self.target = target
        self.history: list[int] = []

    def observe(self, tokens, first_position, target_out, num_committed) -> None:
        del self.history[first_position:]
        self.history += list(tokens[:num_committed])

    def propose(self, anchor_token, anchor_position, k, params) -> Proposal:
        prefix = self.history[:anchor_position] + [anchor_token]
        tokens, cands, probs = peek(self.target, prefix, anchor_position, k, params.greedy, params.seed)
        return Proposal(torch.tensor(tokens), cands, probs)


class PeekingDrafter:
    """The fast engine's Proposer protocol (fast/speculative/proposer.py), implemented directly; remembers each
    slot's committed tokens from what it observes."""

    reads_block_tables = False
    observes_taps_only = False

    def __init__(self, target: ReferenceTarget):
        self.target = target
        self.history: dict[int, list[int]] = {}
        self.num_proposals = 0

    def observe(self, batch, out, num_committed) -> None:
        tokens, positions = batch.token_ids.tolist(), batch.positions.tolist()
        cu, slots = batch.cu_seqlens.tolist(), batch.state_slots.tolist()
        kept = batch.seq_lens.tolist() if num_committed is None else num_committed.tolist()
        for b, slot in enumerate(slots):
            history = self.history.setdefault(slot, [])
            del history[positions[cu[b]]:]
            history += tokens[cu[b]:cu[b] + kept[b]]

    def slot_states(self) -> tuple:
        return ()

    def propose(self, anchor_tokens, anchor_positions, slots, block_tables, k, st) -> DraftProposal:
        out = []
        seeds = [s % 2**64 for s in st.seeds.tolist()]
        for b, (anchor, s, slot) in enumerate(zip(anchor_tokens.tolist(), anchor_positions.tolist(), slots.tolist())):
            prefix = self.history[slot][:s] + [anchor]
            out.append(peek(self.target, prefix, s, k, bool(st.greedy[b]), seeds[b]))
        self.num_proposals += len(out)
        device = anchor_tokens.device
        return DraftProposal(torch.tensor([o[0] for o in out], device=device),
                             torch.stack([o[1] for o in out]).to(device), torch.stack([o[2] for o in out]).to(device))
