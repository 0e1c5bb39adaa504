"""DFlash 2 as a batched proposer: twin of ``reference/speculative/dflash.py`` and ``reference/speculative/selector.py``.

After every target forward (a prefill chunk or a verify), over the N rows of all its requests::

    c = draft.context_rows(features)          [N, C]            features: the tapped layers, [N, m*C]
    window.write(slots, positions, c)          the dflash_window slot state (for prefix-cache restores)
    k, v = draft.context_kv(c, positions)      [L, N, Hkv, D]
    ring.write(slots, positions, k, v)         every row, before acceptance is known

A verify's rejected rows are written too and never read: the next anchor's window ends before
them (``reference/speculative/ring.py``). To propose for B requests, anchor t0_b at s_b in slot r_b::

    blocks = draft.forward_blocks(t0, s, ring, r)        all B blocks, always the full S rows
    walk over the top-K_sel candidates of slots 1..k     batched over B, sequential over i

The walk (facts sheet section 3): C_i = the K_sel largest logits (logit descending, token id
ascending on ties), sigma_i[j] = z_i[C_i[j]] + <A[y_{i-1}] * P h_i, Bc[C_i[j]]>; a greedy request
takes argmax sigma_i (lowest index on ties) and reports q one-hot; a sampled one draws
j ~ q_i = softmax(sigma_i / T) by inverting the CDF in candidate order with
u_i = uniform(seed, s, SELECTOR, i): the smallest j with cumsum(q_i)[j] > u_i * sum(q_i) (fp64),
never a candidate with q = 0. Greedy and sampled requests share a batch.

The walk is ``fast/kernels/draft/selector.select`` (Triton on CUDA, its torch twin elsewhere).

Under the :class:`~.proposer.Proposer` protocol: ``observe`` reads the taps alone (``observes_taps_only``,
so a captured verify step runs it beside the rest of the step) and ``propose`` reads no block table
(``reads_block_tables`` False: the draft attends over its own ring).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.draft.selector import select
from ..kernels.sampling.sampler import SamplingTensors
from ..model.batch import PAD_SLOT, ForwardBatch
from ..model.draft import FastDraft
from ..model.target import FastOutput
from .proposer import DraftProposal
from .ring import RING_MARGIN, RingPool, WindowPool


class FastDFlashProposer:
    """The draft, its per-slot K/V rings and the dflash_window slot state, for every request at once.

    ``num_slots``: the target's GDN state slots (the ring and the window are indexed by the same
    ``state_slots``). ``poison=True`` fills fresh rings and windows with NaN (tests).
    """

    reads_block_tables = False  # the draft attends over its own ring, not the target's pages
    observes_taps_only = True

    def __init__(self, draft: FastDraft, num_slots: int, *, margin: int = RING_MARGIN, poison: bool = False,
                 num_snapshots: int = 0, rebuild_group: int | None = None):
        cfg = draft.cfg
        self.draft, self.cfg = draft, cfg
        common = dict(margin=margin, dtype=draft.dtype, device=draft.device, poison=poison)
        self.ring = RingPool(num_slots, cfg.sliding_window, cfg.num_hidden_layers, cfg.num_key_value_heads,
                             cfg.head_dim, **common)
        self.window = WindowPool(num_slots, cfg.sliding_window, cfg.hidden_size, num_saved=num_snapshots, **common)
        # ring rebuilds per call on a prefix-cache load: bounds the temporaries to the memory plan's workspace
        self.rebuild_group = rebuild_group or num_slots
        p = "candidate_selector."
        # [r, C] in the draft dtype: the walk's g = h P^T runs in fp32, and project_triton converts P as it loads it
        # (exactly; the same g bit for bit as from an fp32 copy, and faster at the released shape, measured in
        # bench/results/2026-12-04-h200-perf13/); the torch walk converts it per step
        self.hidden_projection = draft.w[f"{p}hidden_projection.weight"]
        self.predecessor_codebook = draft.w[f"{p}predecessor_codebook"]  # [V, r]
        self.successor_codebook = draft.w[f"{p}successor_codebook"]  # [V, r]

    # -- after every target forward ---------------------------------------------------------------

    def observe(self, batch: ForwardBatch, out: FastOutput, num_committed: Tensor | None) -> None:
        """Every row of a target step, acceptance unknown (rejected rows are never read)."""
        self.observe_taps(batch, out.taps)

    def observe_rows(self, slots: Tensor, positions: Tensor, features: Tensor) -> None:
        """Context rows and ring K/V of N target rows of many requests (verify rows before acceptance).

        slots: ``[N]`` long, each row's GDN state slot (PAD_SLOT: a padding row, writes nothing);
        positions: ``[N]`` long absolute; features: ``[N, m*C]`` the residual outputs of the target
        layers ``target_layer_ids`` (HF ``hidden_states[id + 1]``), concatenated in that order.
        """
        rows = self.draft.context_rows(features)  # [N, C]
        self.window.write(slots, positions, rows)
        k, v = self.draft.context_kv(rows, positions)  # [L, N, Hkv, D] each
        self.ring.write(slots, positions, k, v)

    def observe_taps(self, batch: ForwardBatch, taps: Tensor) -> None:
        """:meth:`observe_rows` for every row of a target step; padding rows and sequences write nothing."""
        slots = batch.state_slots[batch.seq_index()]
        slots = torch.where(batch.kv_slot_mapping == PAD_SLOT, PAD_SLOT, slots)
        self.observe_rows(slots, batch.positions, taps)

    # -- before every verify ----------------------------------------------------------------------

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor | None,
                k: int, st: SamplingTensors) -> DraftProposal:
        """The protocol's propose: :meth:`propose_drafts` with the requests' sampling tensors (no block table read)."""
        return self.propose_drafts(anchor_tokens, anchor_positions, slots, k, st.greedy, st.temperature, st.seeds,
                                   all_greedy=st.all_greedy)

    def slot_states(self) -> tuple[RingPool, WindowPool]:
        return self.ring, self.window

    def propose_drafts(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, k: int, greedy: Tensor,
                       temperatures: Tensor, seeds: Tensor, all_greedy: bool = False) -> DraftProposal:
        """k drafts for each of B requests: anchor t0 (committed, not yet run through the target) at s.

        anchor_tokens, anchor_positions, slots: ``[B]`` long; greedy: ``[B]`` bool; temperatures:
        ``[B]`` float (> 0 where not greedy); seeds: ``[B]`` int64 (uint64 bit patterns, see
        ``fast/kernels/sampling/philox.seeds_tensor``). k: 1 .. block_size - 1, the same for the batch.
        ``all_greedy``: the host knows every request is greedy (the torch walk then draws nothing).
        """
        if not 1 <= k <= self.cfg.block_size - 1:
            raise ValueError(f"k={k}: expected 1 .. {self.cfg.block_size - 1} (block_size - 1)")
        # a padding request (slot PAD_SLOT, e.g. filling a CUDA-graph bucket) reads the all-zero slot
        slots = torch.where(slots < 0, self.ring.zero_slot, slots)
        blocks = self.draft.forward_blocks(anchor_tokens, anchor_positions, self.ring, slots)
        walk = select(blocks.logits, blocks.hidden, self.hidden_projection, self.predecessor_codebook,
                      self.successor_codebook, anchor_tokens, k, self.cfg.selector_top_k, temperatures.float(),
                      greedy, seeds, anchor_positions, all_greedy=all_greedy)
        return DraftProposal(walk.tokens, walk.cand_ids, walk.draft_probs)

    # -- prefix cache -----------------------------------------------------------------------------

    def save_state(self, slots: Tensor, snapshots: Tensor) -> None:
        """Snapshot the dflash_window of request ``slots`` into snapshot slots (the protocol's ``save_state``)."""
        self.window.save(slots, snapshots)

    def load_state(self, snapshots: Tensor, slots: Tensor, frontiers: Tensor) -> None:
        """Restore windows from snapshot slots and rebuild each ring at its frontier, ``rebuild_group`` slots per
        call (the protocol's ``load_state``)."""
        self.window.load(snapshots, slots)
        for start in range(0, slots.shape[0], self.rebuild_group):
            self.restore(slots[start:start + self.rebuild_group], frontiers[start:start + self.rebuild_group])

    def restore(self, slots: Tensor, frontiers: Tensor) -> None:
        """Rebuild the rings of ``slots [R]`` from their windows at ``frontiers [R]`` (the next anchor f).

        Projects the R * (W-1) rows f-W+1 .. f-1 in one call; afterwards each ring reads at f
        exactly what live decoding held there.
        """
        positions, rows, valid = self.window.read(slots, frontiers)  # [R, W-1], [R, W-1, C], [R, W-1]
        r, t = positions.shape
        k, v = self.draft.context_kv(rows.reshape(r * t, -1), positions.reshape(r * t))  # [L, R*T, Hkv, D]
        self.ring.rebuild(slots, positions, k.unflatten(1, (r, t)), v.unflatten(1, (r, t)), valid)
