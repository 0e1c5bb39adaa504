"""The prefix cache's device side: snapshot slots of the request state, and page copies.

A snapshot slot holds what a request's GDN state slot holds and no page does: the target's GDN state
of every linear-attention layer (``conv [L, S, conv_dim, K-1]`` in the pool dtype, ``recurrent
[L, S, Hv, Dk, Dv]`` fp32, as ``fast/model/pools.GDNStack``) and the proposer's slot state, which the
proposer keeps itself (``save_state`` / ``load_state``: DFlash its ``dflash_window`` rows, rebuilding the
K/V ring from them on a load; MTP its pending hidden row). The K/V of the prefix stays in the pages the
cache keeps (``prefix_cache.py``); a resumed request's one private page is a copy (``copy_pages``).

Every operation is a batched copy on the current stream, so it lands between the steps that surround it:
a save after the step that left the state there, a load before the step that reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model.pools import CachePools


class StateSnapshots:
    """``num_snapshots`` snapshot slots beside ``pools``' state slots; ``proposer`` may be None (plain decoding)."""

    def __init__(self, pools: CachePools, proposer, num_snapshots: int):
        stack = pools.gdn_stack
        layers = stack.conv_storage.shape[0]
        self.pools, self.proposer, self.num_snapshots = pools, proposer, num_snapshots
        self.conv = torch.zeros((layers, num_snapshots, *stack.conv_storage.shape[2:]), dtype=stack.conv_storage.dtype,
                                device=pools.device)
        self.recurrent = torch.zeros((layers, num_snapshots, *stack.recurrent_storage.shape[2:]),
                                     dtype=torch.float32, device=pools.device)

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.pools.device)

    def save(self, slots: Sequence[int], snapshots: Sequence[int]) -> None:
        """Copy the state of request slots ``slots`` into snapshot slots ``snapshots`` (pairwise)."""
        if not slots:
            return
        src, dst = self._index(slots), self._index(snapshots)
        stack = self.pools.gdn_stack
        self.conv[:, dst] = stack.conv_storage[:, src]
        self.recurrent[:, dst] = stack.recurrent_storage[:, src]
        if self.proposer is not None:
            self.proposer.save_state(src, dst)

    def load(self, snapshots: Sequence[int], slots: Sequence[int], frontiers: Sequence[int]) -> None:
        """Copy snapshot slots into request slots; the proposer rebuilds what it derives from its state at each
        request's frontier (the snapshot's length: the next position to run)."""
        if not slots:
            return
        src, dst = self._index(snapshots), self._index(slots)
        stack = self.pools.gdn_stack
        stack.conv_storage[:, dst] = self.conv[:, src]
        stack.recurrent_storage[:, dst] = self.recurrent[:, src]
        if self.proposer is not None:
            self.proposer.load_state(src, dst, self._index(frontiers))

    def copy_pages(self, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        """Copy whole KV pages (every full-attention layer and the MTP layer) page to page."""
        if not src_pages:
            return
        size = self.pools.page_size
        offsets = torch.arange(size, device=self.pools.device)
        src = (self._index(src_pages)[:, None] * size + offsets).flatten()
        dst = (self._index(dst_pages)[:, None] * size + offsets).flatten()
        layers = list(self.pools.attention.values()) + ([self.pools.mtp] if self.pools.mtp is not None else [])
        for kv in layers:
            kv.key_storage[dst] = kv.key_storage[src]
            kv.value_storage[dst] = kv.value_storage[src]
