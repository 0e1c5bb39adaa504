"""Per-slot DFlash rings on the device: twin of ``reference/speculative/ring.py``, for every request at once.

Two stores, both with capacity C = W + margin (2048 + 64 = 2112) rows per slot and the ring rule
slot(p) = p mod C, so everything ``reference/speculative/ring.py`` proves carries over slot by slot:

- ``RingPool``: each draft layer's post-RoPE context K/V, ``k, v [L, num_slots, C, Hkv, D]``. The
  draft block anchored at s reads positions s-W+1 .. s-1 (those >= 0). Rows are written for every
  target row before acceptance is known; rows past the committed frontier stay within
  [f, f+margin] and so never alias a readable slot.
- ``WindowPool``: the ``dflash_window`` slot state, the context rows c_p themselves,
  ``rows [num_slots, C, hidden]``, indexed by the target's GDN state slot. ``save`` / ``load`` move a
  slot's whole window to a prefix-cache snapshot slot and back, beside its GDN state; after a load at
  frontier f, the ring is rebuilt from the window's rows f-W+1 .. f-1 (``FastDFlashProposer.restore``).

Both keep a tag per row, the position written there (-1: never), for ``check_readable``: a
host-synchronising audit that raises ``StaleSlotError`` where a readable row is not the one
expected. The hot path never reads tags; it masks positions < 0 and relies on the invariant.

Layout: slots 0 .. num_slots-1, then a trash slot that padding rows (slot ``PAD_SLOT`` = -1)
write and nobody reads, then a zero slot that nobody writes: reads of positions before 0 gather
from it, so they come back zero without a masked copy of the whole window. Fresh buffers are
zeros, or NaN with ``poison=True`` (tests), the zero slot excepted.

Writes are batched over the rows of many requests. Within one write, a later row for the same
(slot, ring row) wins, as in the reference: every row aimed at a taken place carries the last
one's data, so the result does not depend on the order a device applies duplicate indices in.
"""

from __future__ import annotations

import torch
from torch import Tensor

RING_MARGIN = 64
TAG_BYTES = 8  # one int64 position tag per row
NEVER_WRITTEN = -1


class StaleSlotError(RuntimeError):
    """A readable position's row holds another position (stale, rejected or never written)."""


class _SlotRings:
    """Shared bookkeeping: ``num_slots`` rings of C = window + margin rows, plus the trash and zero slots."""

    def __init__(self, num_slots: int, window: int, margin: int, device: torch.device | str):
        """Tags for ``num_slots`` slots, the trash slot (index num_slots) and the zero slot (num_slots + 1)."""
        if not (isinstance(num_slots, int) and num_slots >= 1):
            raise ValueError(f"num_slots={num_slots!r}: expected an integer >= 1")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window={window!r}: expected an integer >= 1")
        if not (isinstance(margin, int) and margin >= 0):
            raise ValueError(f"margin={margin!r}: expected an integer >= 0")
        self.num_slots, self.window, self.margin = num_slots, window, margin
        self.capacity = window + margin
        self.device = torch.device(device)
        self.trash_slot, self.zero_slot = num_slots, num_slots + 1
        self.tags = torch.full((num_slots + 2, self.capacity), NEVER_WRITTEN, dtype=torch.long, device=self.device)

    def _fresh(self, row_shape: tuple[int, ...], dtype: torch.dtype, poison: bool,
               num_layers: int | None = None) -> Tensor:
        """A store ``[(L,) num_slots + 2, C, *row_shape]``: zeros, or NaN with ``poison``; the zero slot zero."""
        lead = () if num_layers is None else (num_layers,)
        rows = torch.full((*lead, self.num_slots + 2, self.capacity, *row_shape), float("nan") if poison else 0.0,
                          dtype=dtype, device=self.device)
        rows.select(len(lead), self.zero_slot).zero_()
        return rows

    def ring_index(self, positions: Tensor) -> Tensor:
        """slot(p) = p mod C  # any shape."""
        return positions % self.capacity

    def _slot_rows(self, slots: Tensor) -> Tensor:
        """Pool rows of ``slots``: PAD_SLOT (< 0) goes to the trash slot  # [N] -> [N]."""
        return torch.where(slots < 0, self.trash_slot, slots)

    def _targets(self, slots: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(pool row, ring index, the source row each write takes its data from)  # each [N]."""
        if slots.dim() != 1 or slots.shape != positions.shape:
            raise ValueError(f"slots {list(slots.shape)} and positions {list(positions.shape)}: expected [N] each")
        rows, index = self._slot_rows(slots), self.ring_index(positions)
        flat = rows * self.capacity + index  # [N]
        last = torch.full(((self.num_slots + 1) * self.capacity,), -1, dtype=torch.long, device=self.device)
        last.scatter_reduce_(0, flat, torch.arange(flat.numel(), device=self.device), reduce="amax")
        return rows, index, last[flat]

    def readable(self, anchors: Tensor) -> tuple[Tensor, Tensor]:
        """The positions a block anchored at s reads, s-W+1 .. s-1, and which exist (>= 0)  # [B] -> [B, W-1] x2."""
        positions = anchors[:, None] - (self.window - 1) + torch.arange(self.window - 1, device=self.device)
        return positions, positions >= 0

    def _read_index(self, slots: Tensor, anchors: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(positions, valid, pool slot, ring row) of each readable row  # [B, W-1] each.

        Rows before position 0 read the zero slot.
        """
        positions, valid = self.readable(anchors)
        slot_rows = torch.where(valid, slots[:, None], self.zero_slot)
        return positions, valid, slot_rows, self.ring_index(positions)

    def check_readable(self, slots: Tensor, anchors: Tensor) -> None:
        """Raise ``StaleSlotError`` unless every readable row holds its position (host sync; audits only)."""
        positions, valid = self.readable(anchors)
        held = self.tags[slots[:, None], self.ring_index(positions)]  # [B, W-1]
        bad = torch.nonzero(valid & (held != positions))
        if bad.numel():
            b, j = (int(x) for x in bad[0])
            p, tag = int(positions[b, j]), int(held[b, j])
            what = "was never written" if tag == NEVER_WRITTEN else f"holds position {tag}"
            raise StaleSlotError(f"slot {int(slots[b])}, anchor {int(anchors[b])}: ring row {p % self.capacity} "
                                 f"for position {p} {what} ({bad.shape[0]} bad rows)")

    def _forget(self, slots: Tensor) -> None:
        self.tags[slots] = NEVER_WRITTEN


class RingPool(_SlotRings):
    """Context K/V of every draft layer, one ring per slot: ``k, v [L, num_slots + 2, C, Hkv, D]``."""

    def __init__(self, num_slots: int, window: int, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 margin: int = RING_MARGIN, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 poison: bool = False):
        super().__init__(num_slots, window, margin, device)
        self.k = self._fresh((num_kv_heads, head_dim), dtype, poison, num_layers)
        self.v = self._fresh((num_kv_heads, head_dim), dtype, poison, num_layers)

    @staticmethod
    def bytes_per_slot(window: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       margin: int = RING_MARGIN) -> int:
        """One slot's K and V rows of every layer plus its int64 position tags (for memory sizing)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (window + margin) * (2 * num_layers * num_kv_heads * head_dim * itemsize + TAG_BYTES)

    def write(self, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Store rows of many requests: row n at ring index positions[n] mod C of slot slots[n].

        slots, positions: ``[N]`` long; k, v: ``[L, N, Hkv, D]``. PAD_SLOT rows write nothing.
        """
        expected = (self.k.shape[0], slots.shape[0], *self.k.shape[3:])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"k {list(k.shape)}, v {list(v.shape)}: expected {list(expected)}")
        rows, index, source = self._targets(slots, positions)
        self.k[:, rows, index] = k[:, source].to(self.k.dtype)
        self.v[:, rows, index] = v[:, source].to(self.v.dtype)
        self.tags[rows, index] = positions[source]

    def gather(self, layer: int, slots: Tensor, anchors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Layer ``layer``'s readable window of each block: ``k, v [B, W-1, Hkv, D]`` (row j at position
        s-W+1+j, zero before position 0) and ``valid [B, W-1]``.  slots, anchors: ``[B]`` long."""
        _, valid, slot_rows, index = self._read_index(slots, anchors)
        return self.k[layer][slot_rows, index], self.v[layer][slot_rows, index], valid

    def rebuild(self, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> None:
        """Forget ``slots [R]`` entirely, then write the rows of each (prefix-cache restore).

        positions, valid: ``[R, T]``; k, v: ``[L, R, T, Hkv, D]``; rows with ``valid`` false write
        nothing. Normally T = W-1 rows ending at the restored frontier f-1 (``WindowPool.read``).
        """
        self._forget(slots)
        self.k[:, slots] = 0
        self.v[:, slots] = 0
        r, t = positions.shape
        flat_slots = torch.where(valid, slots[:, None], -1).reshape(r * t)
        self.write(flat_slots, positions.reshape(r * t), k.flatten(1, 2), v.flatten(1, 2))


class WindowPool(_SlotRings):
    """The ``dflash_window`` slot state: context rows c_p per GDN state slot, ``rows [num_slots + 2, C, hidden]``."""

    def __init__(self, num_slots: int, window: int, hidden_size: int, *, margin: int = RING_MARGIN,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", poison: bool = False,
                 num_saved: int = 0):
        super().__init__(num_slots, window, margin, device)
        self.rows = self._fresh((hidden_size,), dtype, poison)
        # prefix-cache snapshot slots: whole windows (rows and tags) saved from request slots and loaded back
        self.saved_rows = torch.zeros((num_saved, self.capacity, hidden_size), dtype=dtype, device=self.device)
        self.saved_tags = torch.full((num_saved, self.capacity), NEVER_WRITTEN, dtype=torch.long, device=self.device)

    @staticmethod
    def bytes_per_slot(window: int, hidden_size: int, dtype: torch.dtype, margin: int = RING_MARGIN) -> int:
        """One slot's context rows plus its int64 position tags (for memory sizing)."""
        return (window + margin) * (hidden_size * torch.empty((), dtype=dtype).element_size() + TAG_BYTES)

    def write(self, slots: Tensor, positions: Tensor, rows: Tensor) -> None:
        """Store context rows ``rows [N, hidden]`` of many requests; PAD_SLOT rows write nothing."""
        if rows.shape != (slots.shape[0], self.rows.shape[-1]):
            raise ValueError(f"rows {list(rows.shape)}: expected [{slots.shape[0]}, {self.rows.shape[-1]}]")
        slot_rows, index, source = self._targets(slots, positions)
        self.rows[slot_rows, index] = rows[source].to(self.rows.dtype)
        self.tags[slot_rows, index] = positions[source]

    def save(self, slots: Tensor, saved: Tensor) -> None:
        """Snapshot the windows of request ``slots`` into snapshot slots ``saved``  # [R] each."""
        self.saved_rows[saved] = self.rows[slots]
        self.saved_tags[saved] = self.tags[slots]

    def load(self, saved: Tensor, slots: Tensor) -> None:
        """Restore snapshot slots ``saved`` into request ``slots``  # [R] each."""
        self.rows[slots] = self.saved_rows[saved]
        self.tags[slots] = self.saved_tags[saved]

    def read(self, slots: Tensor, frontiers: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The rows a ring rebuild at frontier f needs: positions f-W+1 .. f-1 of each slot.

        slots, frontiers: ``[R]`` long. Returns ``positions [R, W-1]``, ``rows [R, W-1, hidden]``
        (zero before position 0) and ``valid [R, W-1]``.
        """
        positions, valid, slot_rows, index = self._read_index(slots, frontiers)
        return positions, self.rows[slot_rows, index], valid
