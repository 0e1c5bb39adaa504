"""The contract between the engine and the batched model forwards: one step's rows and the cache pools.

Layout is token-major and flattened: the rows of B sequences are concatenated into N rows,
``cu_seqlens [B+1]`` marks where each sequence's rows start. A step is either a prefill batch
(chunks of prompts, any number of rows per sequence) or a decode/verify batch (for each running
sequence its anchor and its k drafts: k+1 rows, k = 0 for plain decoding). Padding rows (to fill a
CUDA-graph bucket) carry ``kv_slot_mapping = -1`` and write nothing; they form padding sequences
whose ``state_slots`` entry is ``-1`` too, so they read the zero GDN state and write no slot.

GDN state at the start of a step: a sequence whose first row in the step sits at position 0 starts
from the zero state (its slot's old content is never read); any other sequence continues from its
slot. The MTP head's K/V is paged like the target's, with the same page tables (fast/model/pools.py).

``max_query_len`` (optional, host-side): the most rows any sequence has in this step. The engine
knows it without looking at device memory; when it is ``None`` the model reads it from
``cu_seqlens`` with one device sync (which a CUDA graph cannot capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAD_SLOT = -1


@dataclass
class ForwardBatch:
    token_ids: Tensor  # [N] long
    positions: Tensor  # [N] long, absolute positions in each sequence
    cu_seqlens: Tensor  # [B+1] int32: sequence b owns rows cu_seqlens[b] .. cu_seqlens[b+1]-1
    state_slots: Tensor  # [B] long: the sequence's GDN state slot (also indexes its DFlash ring); PAD_SLOT: padding
    kv_slot_mapping: Tensor  # [N] long: flat KV slot (page * page_size + offset) for row n's K/V; PAD_SLOT writes nothing
    block_tables: Tensor  # [B, max_pages] int32: the KV pages of each sequence, in order (-1 past the end)
    context_lens: Tensor  # [B] long: tokens in each sequence's KV after this step's writes
    is_verify: bool  # decode/verify batch: keep each row's GDN inputs so ``commit`` can replay some
    logits_rows: Tensor  # [M] long: the rows whose logits the step needs
    max_query_len: int | None = None  # host-side max of seq_lens; None: read from cu_seqlens (one sync)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_lens(self) -> Tensor:
        """Rows of each sequence in this step  # [B]."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    def seq_index(self) -> Tensor:
        """The sequence each row belongs to  # [N] long."""
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=self.token_ids.device), self.seq_lens,
                                       output_size=self.token_ids.shape[0])
