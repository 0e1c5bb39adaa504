"""MTP as a batched proposer: twin of ``reference/speculative/mtp.py``, over ``fast/model/mtp.FastMTP``.

The MTP head reads pairs (h_p, t_{p+1}) at position p; its K/V is paged with the target's page
tables (the pair at p writes slot(p), ``fast/model/pools.py``). With the anchor t0 at s and the
target's hidden h_{s-1} (the row that predicted t0)::

    step 1: (h_{s-1}, t0) at s-1 -> y_1 = argmax logits
    step j: (m_{j-1}, y_{j-1}) at s+j-2 -> y_j              m = the MTP's own output hidden

so q is one-hot (K = 1). Per request, the state between steps is ``pending``: the target hidden of
the last committed row, waiting for the next anchor token (its pair is step 1 of the next chain).

``observe`` after a target step over rows a..a+n-1 of a sequence runs one MTP forward over the same
row layout, shifted one position back: row j is the pair at a-1+j, i.e. (pending, t_a) for j = 0
and (h_{a-1+j}, t_{a+j}) after, the next tokens being the step's own ``token_ids`` (a sequence
starting at 0 gets a pair at -1 that sees and writes nothing). Its last row's pair waits in
``pending``. Pairs past the committed frontier (a verify's rejected rows, and the committed row
whose next token is only sampled after the step) are computed too and land past the committed
context: never read, because the next chain's step 1 rewrites slot(s-1) and each later step
writes its own position before reading it. That is the reference's truncation of the chained
entries, without moving anything.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.sampling.sampler import SamplingTensors
from ..model.batch import PAD_SLOT, ForwardBatch
from ..model.mtp import FastMTP
from ..model.pools import CachePools
from ..model.target import FastOutput
from .proposer import DraftProposal


def kv_slots_of(block_tables: Tensor, positions: Tensor, page_size: int) -> Tensor:
    """Flat K/V slot of ``positions [B]`` through each row's ``block_tables [B, P]``; PAD_SLOT below 0  # [B]."""
    clamped = positions.clamp(min=0)
    pages = block_tables.long().gather(1, (clamped // page_size)[:, None]).squeeze(1)
    return torch.where((positions >= 0) & (pages >= 0), pages * page_size + clamped % page_size, PAD_SLOT)


class FastMTPProposer:
    """Chained argmax drafts of the target's MTP head for every request at once (see the module docstring).

    Under the :class:`~.proposer.Proposer` protocol: ``observe`` reads the final hidden rows and the committed
    counts (not the taps alone), and ``propose`` reads the block tables (the MTP layer attends over paged K/V).
    Its per-slot state, the pending hidden row, is one row a slot (no ``slot_states`` to report); the prefix cache
    saves and loads it (``save_state`` / ``load_state``).
    """

    reads_block_tables = True
    observes_taps_only = False

    def __init__(self, mtp: FastMTP, pools: CachePools, num_snapshots: int = 0):
        if pools.mtp is None:
            raise ValueError("the cache pools hold no MTP K/V (built with mtp=False)")
        self.mtp, self.pools = mtp, pools
        # the target hidden of each slot's last committed row (+ a trash row for padding sequences)
        self.pending = torch.zeros((pools.num_slots + 1, mtp.cfg.hidden_size), dtype=mtp.dtype, device=pools.device)
        # prefix-cache snapshot slots of ``pending``: on a resume at b the first pair (h_{b-1}, t_b) needs h_{b-1}
        self.saved_pending = torch.zeros((num_snapshots, mtp.cfg.hidden_size), dtype=mtp.dtype, device=pools.device)

    def observe(self, batch: ForwardBatch, out: FastOutput, num_committed: Tensor | None) -> None:
        """The target ran ``batch``; the first ``num_committed[b]`` rows of sequence b are committed (None: all, a
        prefill chunk). Reads ``out.hidden [N, C]``, the rows after the final norm."""
        self.observe_hidden(batch, out.hidden, num_committed)

    def slot_states(self) -> tuple:
        return ()

    def save_state(self, slots: Tensor, snapshots: Tensor) -> None:
        """Snapshot the pending rows of request ``slots`` (the protocol's ``save_state``)."""
        self.saved_pending[snapshots] = self.pending[slots]

    def load_state(self, snapshots: Tensor, slots: Tensor, frontiers: Tensor) -> None:
        """Restore pending rows; the resumed prefill's first pair then rewrites the MTP row at frontier - 1."""
        self.pending[slots] = self.saved_pending[snapshots]

    def observe_hidden(self, batch: ForwardBatch, target_hidden: Tensor, num_committed: Tensor | None) -> None:
        """:meth:`observe` from ``target_hidden [N, C]``."""
        rows = torch.arange(batch.token_ids.shape[0], device=target_hidden.device)
        seq = batch.seq_index()  # [N]
        first_rows = batch.cu_seqlens[:-1].long()  # [B]
        first = rows == first_rows[seq]  # [N]
        slot_rows = self.pools.state_index(batch.state_slots)  # [B]
        previous = torch.roll(target_hidden, 1, dims=0)  # row n-1's hidden
        pending = torch.where(batch.positions[:, None] > 0, self.pending[slot_rows[seq]], 0)
        hidden = torch.where(first[:, None], pending, previous).to(self.mtp.dtype)  # h_{p-1} for the row at p

        first_positions = batch.positions[first_rows.clamp(max=rows.numel() - 1)] - 1  # [B]
        first_slots = kv_slots_of(batch.block_tables, first_positions, self.pools.page_size)
        first_slots = torch.where(batch.state_slots < 0, PAD_SLOT, first_slots)
        kv_slots = torch.where(first, first_slots[seq], torch.roll(batch.kv_slot_mapping, 1))
        pairs = ForwardBatch(token_ids=batch.token_ids, positions=batch.positions - 1, cu_seqlens=batch.cu_seqlens,
                             state_slots=batch.state_slots, kv_slot_mapping=kv_slots, block_tables=batch.block_tables,
                             context_lens=batch.context_lens - 1, is_verify=False,
                             logits_rows=rows[:0], max_query_len=batch.max_query_len)
        self.mtp.forward(hidden, pairs, self.pools)

        kept = batch.seq_lens if num_committed is None else num_committed.to(first_rows.device).long()
        self.pending[slot_rows] = target_hidden[first_rows + kept - 1].to(self.pending.dtype)

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor | None,
                k: int, st: SamplingTensors) -> DraftProposal:
        """k chained argmax drafts per request: anchor t0 at s, GDN slot ``slots[b]``, the request's
        ``block_tables [B, P]`` (pages for positions up to s+k-2 at least). q is one-hot, K = 1; the drafts are
        argmax whatever the sampling (``st`` is unused: the verify's sparse-q rejection keeps the target's law)."""
        num_seqs = anchor_tokens.shape[0]
        device = anchor_tokens.device
        hidden = self.pending[self.pools.state_index(slots)]  # h_{s-1}
        tokens, positions = anchor_tokens, anchor_positions - 1
        cu_seqlens = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        drafts = []
        for _ in range(k):
            kv_slots = torch.where(slots < 0, PAD_SLOT, kv_slots_of(block_tables, positions, self.pools.page_size))
            step = ForwardBatch(token_ids=tokens, positions=positions, cu_seqlens=cu_seqlens, state_slots=slots,
                                kv_slot_mapping=kv_slots, block_tables=block_tables, context_lens=positions + 1,
                                is_verify=False, logits_rows=cu_seqlens[:-1].long(), max_query_len=1)
            out = self.mtp.forward(hidden, step, self.pools)
            tokens = torch.argmax(out.logits, dim=-1)  # [B], the lowest id on ties
            drafts.append(tokens)
            hidden, positions = out.hidden, positions + 1
        return DraftProposal.deterministic(torch.stack(drafts, dim=1))
