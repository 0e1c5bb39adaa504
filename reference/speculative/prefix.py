"""The prefix cache for one target: snapshots of a request's whole committed state, keyed by its tokens.

A snapshot at frontier f (f tokens run through the target, every one of them committed; the
anchor at position f is known but not run yet) holds

    tokens            t_0 .. t_{f-1}, the key
    cache             a clone of the target cache after t_{f-1}: the GDN conv and recurrent state,
                      the full-attention K/V of positions 0 .. f-1
    proposer_state    ``proposer.snapshot(f)``: DFlash its dflash_window, the context rows c_p of
                      positions max(0, f-W+1) .. f-1; MTP its cache of pairs 0 .. f-2 and h_{f-1};
                      n-gram its history; plain decoding nothing (None)

When snapshots are taken (``speculative_generate`` and plain ``generate``, with a store):

(a) during prefill at every multiple b of ``snapshot_interval`` (b <= len(prompt)): the prefill
    runs in chunks that end at those b, so a snapshot is the state a chunk ends in and nothing is
    recomputed. A run without a store but with the same interval chunks identically, which is what
    makes an uninterrupted run and a restored one equal bit for bit;
(b) when the request finishes, at its last committed position f: the last emitted token is the
    anchor (not run), and after a verify that rejected drafts the cache is the replayed one, so the
    snapshot never holds a rejected row.

A hit: for a prompt x_0 .. x_{n-1}, the snapshot with the largest f < n whose tokens equal
x_0 .. x_{f-1} (at least one token is always prefilled: the first output token needs the logits of
x_{n-1}). Its cache is cloned, the proposer restored from its state, and only x_f .. x_{n-1} are
prefilled, in chunks ending at the multiples of the interval after f.

A store serves one target and one kind of proposer (a plain snapshot has no DFlash window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..model.target import ReferenceTarget, TargetCache, TargetOutput
from .proposer import Proposer


@dataclass(frozen=True)
class Snapshot:
    """A request's committed state at frontier f = ``len(tokens)`` (see the module docstring)."""

    tokens: tuple[int, ...]  # t_0 .. t_{f-1}
    cache: TargetCache  # length f
    proposer_state: object  # what proposer.snapshot(f) returned; None for plain decoding

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixStore:
    """Snapshots by their token tuple; a later snapshot of the same tokens replaces the earlier one."""

    def __init__(self) -> None:
        self.snapshots: dict[tuple[int, ...], Snapshot] = {}

    def __len__(self) -> int:
        return len(self.snapshots)

    def put(self, snapshot: Snapshot) -> None:
        self.snapshots[snapshot.tokens] = snapshot

    def lookup(self, prompt: Sequence[int]) -> Snapshot | None:
        """The snapshot with the largest f < len(prompt) whose tokens are prompt[:f], or None."""
        prompt = tuple(prompt)
        hits = [s for s in self.snapshots.values() if s.length < len(prompt) and prompt[:s.length] == s.tokens]
        return max(hits, key=lambda s: s.length, default=None)


def take_snapshot(tokens: Sequence[int], cache: TargetCache, proposer: Proposer | None) -> Snapshot:
    """The committed state after ``tokens`` ran through the target (``cache.length`` must be their count)."""
    if cache.length != len(tokens):
        raise ValueError(f"cache holds {cache.length} tokens, the key {len(tokens)}: a snapshot is taken at "
                         "the frontier, where both count the committed tokens")
    state = proposer.snapshot(len(tokens)) if proposer is not None else None
    return Snapshot(tuple(tokens), cache.clone(), state)


def restore_longest(target: ReferenceTarget, proposer: Proposer | None, prompt: Sequence[int],
                    store: PrefixStore | None) -> TargetCache:
    """A fresh cache, or a clone of the longest hit's with the proposer restored to its state."""
    hit = store.lookup(prompt) if store is not None else None
    if hit is None:
        return target.new_cache()
    if proposer is not None:
        proposer.restore(hit.proposer_state)
    return hit.cache.clone()  # the snapshot stays as it was, for the next hit


def chunk_ends(begin: int, end: int, interval: int | None) -> list[int]:
    """Where the prefill chunks over positions begin .. end-1 stop: each multiple of the interval in
    (begin, end), then end; just [end] without an interval."""
    if interval is None:
        return [end]
    if not (isinstance(interval, int) and interval >= 1):
        raise ValueError(f"snapshot_interval={interval!r}: expected an integer >= 1 or None")
    first = (begin // interval + 1) * interval
    return list(range(first, end, interval)) + [end]


def prefill(target: ReferenceTarget, proposer: Proposer | None, prompt: Sequence[int], cache: TargetCache,
            snapshot_interval: int | None = None, store: PrefixStore | None = None) -> TargetOutput:
    """Run ``prompt[cache.length:]`` through the target chunk by chunk; returns the last chunk's output.

    The proposer observes each chunk (all its rows committed). A chunk that ends at a multiple of
    ``snapshot_interval`` leaves its end state in ``store`` (rule (a) of the module docstring).
    """
    begin = cache.length
    out = None
    for end in chunk_ends(begin, len(prompt), snapshot_interval):
        chunk = list(prompt[begin:end])
        out = target.forward(torch.tensor(chunk), cache)  # rows begin .. end-1
        if proposer is not None:
            proposer.observe(chunk, begin, out, len(chunk))
        if store is not None and snapshot_interval is not None and end % snapshot_interval == 0:
            store.put(take_snapshot(prompt[:end], cache, proposer))
        begin = end
    return out
