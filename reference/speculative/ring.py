"""The per-request DFlash K/V ring: W + margin slots, slot(p) = p mod (W + margin).

What it stores. One row per absolute position p: whatever the draft reads for context row p
(normally the post-RoPE keys and the values of every draft layer, ``[L, 2, Hkv, D]``; the ring
does not care). Capacity C = W + M with window W (2048) and margin M (64): 2112 slots. Each slot
carries a tag, the position whose row it holds (-1: never written), so a read can tell a slot
that holds its own row from one that holds a stale, overwritten or never-written one.

Reads. The draft block anchored at s (the last committed token t0 sits at s; its row is not
committed yet) has row i at s+i see context positions s+i-W+1 .. s-1; row 0 sees the most, so

    readable(s) = max(0, s-W+1) .. s-1                       at most W-1 positions

and one ``read(s)`` serves every block row. A read checks every tag and raises
``StaleSlotError`` on a mismatch: it never returns a wrong row silently.

Writes happen before acceptance is known: a verify at anchor s writes rows s..s+k for
[t0, y_1..y_k]; then num_accepted a of the drafts are kept and the frontier moves to s+a+1, so
rows s..s+a are committed and rows s+a+1..s+k are garbage that the next write overwrites.
Rollback is implicit: nothing is erased, later writes win.

Frontier and margin. The frontier f is the next position whose row is not committed (= the
anchor s): rows at positions < f are committed. "Up to 65 rows past the committed frontier"
means: every row written but not committed lies at a position in [f, f+M] = f, f+1, .., f+64,
which is M+1 = 65 positions (the frontier's own row plus 64 after it). Keeping it there is the
caller's obligation; the two writers that run ahead of the frontier are a verify (rows f..f+k,
k+1 <= B = 8 of them) and a prefill chunk that runs past a 64-token GDN snapshot boundary b
(relative to that snapshot the frontier is b; the chunk's rows after b must stay in b..b+64 so
that the rows b-W+1..b-1 a restore from b needs are not overwritten).

Invariant I(f): every r in [max(0, f-W+1), f-1] (the committed rows any anchor >= f can read)
sits in slot r mod C with tag r and the row committed for r.
(1) A write at p in [f, f+M] keeps I(f): for such p and r,

    1 <= p - r <= (f + M) - (f - W + 1) = W + M - 1 = C - 1 < C,

    so p != r (mod C) and the write lands in another slot.
(2) Moving the frontier from f to f' <= f+M+1 (after rows f..f'-1 were written since the frontier
    reached f) gives I(f'): the committed row of each p in [f, f'-1] is its latest write, still in
    its slot because positions in [f, f+M] are pairwise distinct mod C (they differ by <= M < C);
    [f'-W+1, f-1] is covered by I(f). A prefill committing n rows at once (n may exceed C) is
    written in order; its last W-1 rows are pairwise distinct mod C, so they survive and I(f+n)
    holds.
(3) Tight: a write at f+M+1 = (f-W+1) + C lands on the slot of f-W+1, which anchor f reads.
(4) Writes only ever land at positions >= the frontier, so a slot tagged r < f holds r's
    committed row: a read at an earlier anchor returns the right rows or raises, never others.

Prefix-cache restore. ``rebuild`` starts from nothing and writes the last W-1 committed rows
before the frontier, exactly readable(f); by the invariant this is all a live ring can be read
for at anchor f, so a read of the rebuilt ring at f equals the live ring's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

RING_MARGIN = 64
NEVER_WRITTEN = -1


class StaleSlotError(RuntimeError):
    """A read found a slot whose tag is not the position it expected (stale or never written)."""


class Ring:
    """A K/V ring of ``window + margin`` slots for one request (see the module docstring)."""

    def __init__(self, window: int, row_shape: Sequence[int], margin: int = RING_MARGIN,
                 dtype: torch.dtype = torch.float32):
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window={window!r}: expected an integer >= 1")
        if not (isinstance(margin, int) and margin >= 0):
            raise ValueError(f"margin={margin!r}: expected an integer >= 0")
        self.window, self.margin = window, margin
        self.capacity = window + margin
        self.row_shape = tuple(row_shape)
        self.rows = torch.zeros((self.capacity, *self.row_shape), dtype=dtype)  # [C, ...]
        self.tags = torch.full((self.capacity,), NEVER_WRITTEN, dtype=torch.long)  # [C]

    def slot(self, positions: Tensor) -> Tensor:
        """slot(p) = p mod C  # [T] -> [T]."""
        return positions % self.capacity

    def readable_positions(self, anchor: int) -> Tensor:
        """max(0, s-W+1) .. s-1 for the anchor s  # [N] long, N = min(s, W-1)."""
        if not (isinstance(anchor, int) and anchor >= 0):
            raise ValueError(f"anchor={anchor!r}: expected an integer position >= 0")
        return torch.arange(max(0, anchor - self.window + 1), anchor, dtype=torch.long)

    def write(self, positions: Tensor, rows: Tensor) -> None:
        """Store ``rows [T, ...]`` at ``positions [T]``, in order: a later row for the same slot wins."""
        positions = torch.as_tensor(positions, dtype=torch.long)
        if positions.dim() != 1 or tuple(rows.shape) != (positions.shape[0], *self.row_shape):
            raise ValueError(f"positions {list(positions.shape)} and rows {list(rows.shape)}: expected [T] and "
                             f"[T, {', '.join(map(str, self.row_shape))}]")
        if positions.numel() == 0:
            return
        if int(positions.min()) < 0:
            raise ValueError(f"position {int(positions.min())}: positions are >= 0")
        slots = self.slot(positions)  # [T]
        # the index of the last row aimed at each slot (-1: none), so an in-order write is well defined
        last = torch.full((self.capacity,), -1, dtype=torch.long)
        last.scatter_reduce_(0, slots, torch.arange(positions.numel()), reduce="amax")
        hit = torch.nonzero(last >= 0).squeeze(1)  # [T'] slots written
        self.rows[hit] = rows[last[hit]].to(self.rows.dtype)
        self.tags[hit] = positions[last[hit]]

    def read(self, anchor: int) -> tuple[Tensor, Tensor]:
        """The context of the block anchored at s: ``(positions [N], rows [N, ...])``, N = min(s, W-1).

        Raises ``StaleSlotError`` if any slot read does not hold the position it is read for.
        """
        positions = self.readable_positions(anchor)  # [N]
        slots = self.slot(positions)
        bad = torch.nonzero(self.tags[slots] != positions).squeeze(1)
        if bad.numel():
            p = int(positions[bad[0]])
            held = int(self.tags[slots[bad[0]]])
            what = "was never written" if held == NEVER_WRITTEN else f"holds position {held}"
            raise StaleSlotError(f"anchor {anchor}: slot {p % self.capacity} for position {p} {what} "
                                 f"({bad.numel()} bad slots of {positions.numel()})")
        return positions, self.rows[slots].clone()

    def rebuild(self, positions: Tensor, rows: Tensor) -> None:
        """Forget everything, then hold the last W-1 of consecutive committed ``rows [N, ...]`` at ``positions [N]``.

        The prefix-cache restore: the rows are a snapshot's window ending at f-1 (f the restored
        frontier); afterwards ``read(f)`` equals what live decoding held at anchor f.
        """
        positions = torch.as_tensor(positions, dtype=torch.long)
        if positions.dim() != 1:
            raise ValueError(f"positions {list(positions.shape)}: expected [N]")
        if positions.numel() > 1 and not bool((positions.diff() == 1).all()):
            raise ValueError("rebuild positions must be consecutive (the snapshot's window, oldest first)")
        keep = max(0, positions.numel() - (self.window - 1))
        self.tags.fill_(NEVER_WRITTEN)
        self.rows.zero_()
        self.write(positions[keep:], rows[keep:])
