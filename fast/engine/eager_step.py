"""The eager step: a step's ForwardBatch built on the host from the scheduler's requests, copied to the device
once, and the target run on it (prefill chunks that replay no captured prefill step, ``graphs/prefill_graphs.py``;
decode and verify steps that fit no captured graph; on the CPU, with ``enforce_eager``, or when a trace or logprobs
are asked for).

A batch is built as whole host tensors (no loop over rows): sequence b runs ``lengths[b]`` rows at positions
``starts[b]..``, its K/V slots through its page table (``graphs/step_buffers.kv_slot_mapping``), its GDN state slot
``req.slot``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Sequence

import torch
from torch import Tensor

from ..model.batch import ForwardBatch
from ..model.pools import CachePools
from ..model.target import FastOutput, FastTarget
from .scheduler import Req
from .graphs.step_buffers import kv_slot_mapping


class EagerStep:
    """Host-built batches and eager forwards of one target over its pools."""

    def __init__(self, target: FastTarget, pools: CachePools, *, page_size: int, device: torch.device):
        self.target, self.pools, self.page_size, self.device = target, pools, page_size, device
        # tensor parallelism: called with each batch before the target runs on it (TPWorkers.forward sends it to
        # the other ranks, which run the same forward on their shards); None at tp=1
        self.before_forward: Callable[[ForwardBatch], None] | None = None

    def tensor(self, values, dtype=torch.long) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @staticmethod
    def page_table(reqs: Sequence[Req], min_pages: int = 0) -> Tensor:
        """Each request's pages in order, -1 past its end  # [B, max_pages] int64 on the host."""
        max_pages = max(min_pages, *(len(r.pages) for r in reqs))
        return torch.tensor([r.pages + [-1] * (max_pages - len(r.pages)) for r in reqs], dtype=torch.long)

    def block_tables(self, reqs: Sequence[Req], min_pages: int = 0) -> Tensor:
        """Each request's pages in order, -1 past its end  # [B, max_pages] int32 on the device.

        ``min_pages`` widens the table: a proposer may address positions a request with fewer drafts
        than the batch never reaches (an MTP chain runs the batch's k); -1 there writes nothing.
        """
        return self.page_table(reqs, min_pages).to(dtype=torch.int32, device=self.device)

    def batch(self, reqs: Sequence[Req], starts: Sequence[int], lengths: Sequence[int], token_ids: Tensor, *,
              is_verify: bool, logits_rows: Sequence[int], block_tables: Tensor | None = None) -> ForwardBatch:
        """Sequence b runs ``lengths[b]`` rows at positions ``starts[b]..``; ``token_ids [N]`` on the device."""
        host_tables = self.page_table(reqs)  # [B, P] int64 on the host
        starts_t, lengths_t = torch.tensor(starts), torch.tensor(lengths)
        cu = torch.zeros(len(reqs) + 1, dtype=torch.long)
        cu[1:] = lengths_t.cumsum(0)
        seq = torch.repeat_interleave(torch.arange(len(reqs)), lengths_t)  # [N] the sequence of each row
        positions = starts_t[seq] + torch.arange(int(cu[-1])) - cu[:-1][seq]  # [N]
        kv_slots = kv_slot_mapping(host_tables, seq, positions, self.page_size)
        to_device = {"device": self.device}
        return ForwardBatch(
            token_ids=token_ids, positions=positions.to(**to_device), cu_seqlens=cu.to(torch.int32).to(**to_device),
            state_slots=self.tensor([r.slot for r in reqs]), kv_slot_mapping=kv_slots.to(**to_device),
            block_tables=host_tables.to(torch.int32).to(**to_device) if block_tables is None else block_tables,
            context_lens=(starts_t + lengths_t).to(**to_device), is_verify=is_verify,
            logits_rows=self.tensor(list(logits_rows)), max_query_len=max(lengths))

    def forward(self, reqs: Sequence[Req], starts: Sequence[int], lengths: Sequence[int], token_ids: Tensor, *,
                is_verify: bool, logits_rows: Sequence[int],
                block_tables: Tensor | None = None) -> tuple[ForwardBatch, FastOutput]:
        """:meth:`batch`, then the target over it. Returns (batch, output)."""
        batch = self.batch(reqs, starts, lengths, token_ids, is_verify=is_verify, logits_rows=logits_rows,
                           block_tables=block_tables)
        if self.before_forward is not None:
            self.before_forward(batch)
        return batch, self.target.forward(batch, self.pools)
