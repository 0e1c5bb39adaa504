"""Per-step metadata, computed once per forward from a :class:`ForwardBatch` and shared by every layer.

Rows stay token-major ``[N, ...]`` at every layer boundary. The torch ops regroup them privately
into a padded per-sequence layout ``[B, Tq, ...]`` (Tq = ``max_query_len``): row n sits at
``[seq_index[n], row_in_seq[n]]``. Each sequence's K/V context is gathered through its block table
into ``[B, Tctx]`` flat slots with ``Tctx = max_pages * page_size`` (a static width: no device
sync), ``kv_valid`` marking the slots below ``context_lens``; those two and ``query_positions`` serve
only that torch form, so they are built on first use: a CUDA step never reads them, and its graph
would otherwise replay their ~15 small kernels every step. Key t of a sequence sits at position
t, so a row at position p sees keys ``t <= p``. The paged-attention kernel reads the pages itself
(``block_tables``, ``context_lens``, ``page_size``), with no gather. A padding sequence
(``state_slots`` -1) has ``context_lens`` 0 here, whatever the batch says: its rows see no key.

Everything here is computed without a device sync, except ``max_query_len`` when the batch does
not carry it. The batch's tensors live on the pools' device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ..kernels.attention.rope import rope_cos_sin
from .batch import ForwardBatch
from .pools import CachePools, zero_state_mask


@dataclass(frozen=True)
class StepMeta:
    num_seqs: int  # B
    max_query_len: int  # Tq
    is_verify: bool
    cu_seqlens: Tensor  # [B+1] long
    seq_lens: Tensor  # [B] long
    seq_index: Tensor  # [N] long: the sequence of each row
    row_in_seq: Tensor  # [N] long: the row's index within its sequence in this step
    positions: Tensor  # [N] long
    zero_state: Tensor  # [B] bool: starts from the zero GDN state
    state_index: Tensor  # [B] long: GDN slot read and written (trash slot for padding sequences)
    kv_write_index: Tensor  # [N] long: flat K/V row written (trash row for padding rows)
    block_tables: Tensor  # [B, P] int32: the pages of each sequence in order, -1 past its end
    context_lens: Tensor  # [B] int32: keys in each sequence's K/V after this step's writes (0: padding)
    page_size: int
    num_kv_slots: int  # flat K/V slots of the pools; kv_gather points padding slots here (the trash row)
    rope_cos: Tensor  # [N, rd/2] fp32
    rope_sin: Tensor  # [N, rd/2] fp32

    @classmethod
    def build(cls, batch: ForwardBatch, pools: CachePools) -> StepMeta:
        cfg, device = pools.cfg, pools.device
        num_rows, num_seqs = batch.token_ids.shape[0], batch.num_seqs
        cu_seqlens = batch.cu_seqlens.long()
        seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]
        max_query_len = batch.max_query_len
        if max_query_len is None:
            max_query_len = int(seq_lens.max()) if num_seqs else 0
        rows = torch.arange(num_rows, device=device)
        seq_index = torch.searchsorted(cu_seqlens[1:], rows, right=True)  # [N]
        row_in_seq = rows - cu_seqlens[seq_index]  # [N]
        positions = batch.positions.long()
        context_lens = torch.where(batch.state_slots < 0, 0, batch.context_lens).to(torch.int32)  # [B]
        rope_cos, rope_sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        return cls(
            num_seqs=num_seqs, max_query_len=max_query_len, is_verify=batch.is_verify, cu_seqlens=cu_seqlens,
            seq_lens=seq_lens, seq_index=seq_index, row_in_seq=row_in_seq, positions=positions,
            zero_state=zero_state_mask(batch), state_index=pools.state_index(batch.state_slots),
            kv_write_index=pools.kv_write_index(batch.kv_slot_mapping),
            block_tables=batch.block_tables.to(torch.int32), context_lens=context_lens, page_size=pools.page_size,
            num_kv_slots=pools.num_kv_slots, rope_cos=rope_cos, rope_sin=rope_sin)

    @cached_property
    def query_positions(self) -> Tensor:
        """Row positions per sequence, -1 past its rows  # [B, Tq] long (torch attention only, built on first use)."""
        out = torch.full((self.num_seqs, self.max_query_len), -1, dtype=torch.long, device=self.positions.device)
        out[self.seq_index, self.row_in_seq] = self.positions
        return out

    @cached_property
    def kv_gather(self) -> Tensor:
        """Flat K/V slot of context position t, ``num_kv_slots`` (the trash row) where not
        ``kv_valid``  # [B, Tctx] long (torch attention only, built on first use)."""
        context = self._context_positions
        pages = self.block_tables.long()[:, context // self.page_size]  # [B, Tctx]
        return torch.where(self.kv_valid, pages * self.page_size + context % self.page_size, self.num_kv_slots)

    @cached_property
    def kv_valid(self) -> Tensor:
        """t < context_lens[b] and its page exists  # [B, Tctx] bool (torch attention only, built on first use)."""
        context = self._context_positions
        pages = self.block_tables[:, context // self.page_size]  # [B, Tctx]
        return (context[None, :] < self.context_lens[:, None]) & (pages >= 0)

    @property
    def _context_positions(self) -> Tensor:
        """0 .. Tctx - 1, Tctx = max_pages * page_size  # [Tctx] long."""
        return torch.arange(self.block_tables.shape[1] * self.page_size, device=self.block_tables.device)

    @cached_property
    def readable_state_index(self) -> Tensor:
        """GDN slot each sequence reads its starting state from, -1 (read nothing) where ``zero_state``  # [B] long.

        Built on first use and kept, so the step's GDN layers share one ``where`` (a cached_property
        writes the instance dict, which the frozen dataclass allows; inside a CUDA-graph capture the
        tensor is captured with the first layer that asks).
        """
        return torch.where(self.zero_state, -1, self.state_index)

    def pad(self, x: Tensor) -> Tensor:
        """Rows ``[N, ...]`` to the padded per-sequence layout ``[B, Tq, ...]`` (zeros past each sequence)."""
        out = x.new_zeros((self.num_seqs, self.max_query_len, *x.shape[1:]))
        out[self.seq_index, self.row_in_seq] = x
        return out

    def unpad(self, x: Tensor) -> Tensor:
        """The padded layout ``[B, Tq, ...]`` back to rows ``[N, ...]``."""
        return x[self.seq_index, self.row_in_seq]
