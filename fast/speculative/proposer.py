"""The Proposer protocol: what a speculative step needs from a drafting method, batched over requests (twin of
``reference/speculative/proposer.py``, which drives one request at a time).

Every proposer (DFlash 2, MTP, yours) implements it directly; the engine's steps talk to nothing else:

1. ``observe(batch, out, num_committed)`` after every target forward (a prefill chunk, a verify): ``out`` is
   the target's ``FastOutput`` (logits, final hidden rows, the tapped layers' rows); the first
   ``num_committed[b]`` rows of sequence b are committed (None: all of them, a prefill). The rest were
   rejected: a proposer may have written state for them but must never read it.
2. ``propose(anchor_tokens, anchor_positions, slots, block_tables, k, st)``: k drafts per request after the
   committed anchor t0 at s (not yet run through the target), with the sparse q each was drawn from
   (:class:`DraftProposal`). Randomness comes from the keyed Philox uniforms of each request's seed
   (``st.seeds``), slot i's at (seed, s, SELECTOR, i).
3. ``slot_states()``: the per-request state it keeps, indexed by the request's GDN state slot (DFlash: the
   K/V ring and the dflash_window); the engine reports their use.
4. ``save_state(slots, snapshots)`` / ``load_state(snapshots, slots, frontiers)``: the prefix cache's
   snapshot of what it keeps per request beyond the paged K/V, beside the target's GDN state
   (``fast/engine/snapshots.py``); a load leaves each request's state as a run that had computed the
   prefix up to its frontier (the next position to run) would hold it: DFlash restores its
   dflash_window and rebuilds the K/V ring from it, MTP its pending hidden row.

Two declarations let a captured step run parts of the step early or beside the rest:

- ``reads_block_tables``: False when ``propose`` reads only its own arguments and per-slot state (then it is
  passed ``block_tables=None``, and a captured step launches the proposal before the batch's other fields
  are uploaded);
- ``observes_taps_only``: True when ``observe`` reads only the batch and ``out.taps``; the step then calls
  ``observe_taps(batch, taps)`` on a side stream as soon as the last tapped layer has written them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor

from ..kernels.sampling.sampler import SamplingTensors
from ..model.batch import ForwardBatch
from ..model.target import FastOutput


@dataclass(frozen=True)
class DraftProposal:
    """Twin of ``reference/speculative/proposer.Proposal`` for B requests (q rows sum to 1; K the same for all)."""

    tokens: Tensor  # [B, k] long: y_1..y_k
    cand_ids: Tensor  # [B, k, K] long: the support of q_i (DFlash: K = K_sel)
    draft_probs: Tensor  # [B, k, K] fp32: q_i over cand_ids (greedy or argmax picks: one-hot)

    @staticmethod
    def deterministic(tokens: Tensor) -> DraftProposal:
        """Every slot picked with certainty: K = 1, q = 1  # tokens [B, k]."""
        return DraftProposal(tokens, tokens[..., None].clone(), torch.ones(*tokens.shape, 1, device=tokens.device))


class SlotState(Protocol):
    """A per-request state a proposer keeps, one entry per GDN state slot."""

    num_slots: int


class Proposer(Protocol):
    """See the module docstring."""

    reads_block_tables: bool
    observes_taps_only: bool

    def observe(self, batch: ForwardBatch, out: FastOutput, num_committed: Tensor | None) -> None:
        """The target ran ``batch``; the first ``num_committed[b]`` rows of sequence b are committed."""

    def observe_taps(self, batch: ForwardBatch, taps: Tensor) -> None:
        """``observe`` from the tapped rows alone; only proposers with ``observes_taps_only`` define it."""

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor | None,
                k: int, st: SamplingTensors) -> DraftProposal:
        """k drafts per request: anchors ``[B]``, GDN slots ``[B]``, ``block_tables [B, P]`` covering positions up
        to s + k (None for a proposer that does not read them), the requests' sampling tensors."""

    def slot_states(self) -> Sequence[SlotState]:
        """The per-slot states this proposer keeps (empty: none)."""

    def save_state(self, slots: Tensor, snapshots: Tensor) -> None:
        """Copy the per-request state of ``slots [R]`` into prefix-cache snapshot slots ``snapshots [R]``."""

    def load_state(self, snapshots: Tensor, slots: Tensor, frontiers: Tensor) -> None:
        """Copy snapshot slots back into request ``slots [R]`` and rebuild what derives from them at ``frontiers``."""
