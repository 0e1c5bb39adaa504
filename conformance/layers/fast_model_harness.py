"""Drive the fast target through engine-like steps beside one reference run per sequence.

A :class:`Seq` is one request: its GDN slot, its KV pages (deliberately scattered), its reference
cache, and how many positions its target K/V holds. :func:`make_batch` packs the rows of several
sequences (and optionally a padding sequence) into a :class:`ForwardBatch` the way the engine
does. :class:`ErrorLog` keeps the largest and the pooled NUMERIC error per quantity, so the suite
can report the fraction of the tolerance it used (printed in the terminal summary by conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash2.fast.model.batch import PAD_SLOT, ForwardBatch

# docs/tolerances.md, NUMERIC rms-relative bounds
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rms_rel(a: Tensor, b: Tensor) -> float:
    """``rms(a - b) / rms(b)`` in float64, on the CPU."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


class ErrorLog:
    """Errors per quantity against one bound: the largest of any single comparison (``max_error``)
    and one rms-relative error over every row compared (``pooled_error``, all steps together)."""

    def __init__(self, name: str, bound: float):
        self.name, self.bound = name, bound
        self.max_error: dict[str, float] = {}
        self.bounds: dict[str, float] = {}  # per-quantity bounds where they differ from ``bound``
        self._sums: dict[str, tuple[float, float]] = {}

    def add(self, quantity: str, fast: Tensor, reference: Tensor) -> float:
        assert torch.isfinite(fast).all(), f"{self.name} {quantity}: non-finite values (a read of unwritten memory?)"
        a, b = fast.detach().cpu().double(), reference.detach().cpu().double()
        diff, ref = self._sums.get(quantity, (0.0, 0.0))
        self._sums[quantity] = (diff + float((a - b).pow(2).sum()), ref + float(b.pow(2).sum()))
        error = rms_rel(a, b)
        self.max_error[quantity] = max(self.max_error.get(quantity, 0.0), error)
        return error

    @property
    def pooled_error(self) -> dict[str, float]:
        return {q: (diff / ref) ** 0.5 for q, (diff, ref) in self._sums.items()}

    def bound_of(self, quantity: str) -> float:
        return self.bounds.get(quantity, self.bound)

    def lines(self) -> list[str]:
        out = []
        for q in sorted(self.max_error):
            worst, pooled, bound = self.max_error[q], self.pooled_error[q], self.bound_of(q)
            used = f" ({worst / bound:.1%} / {pooled / bound:.1%} of {bound:.3g})" if bound != float("inf") else ""
            out.append(f"{self.name} {q}: max {worst:.2e}, pooled {pooled:.2e}{used}")
        return out


REPORT: list[ErrorLog] = []  # every log a test kept, for the terminal summary


@dataclass
class Seq:
    slot: int
    pages: list[int]  # the block table: page of positions [i*page_size, (i+1)*page_size)
    cache: object = None  # the reference's cache for this sequence
    length: int = 0  # positions already in the (target or MTP) K/V
    written: set[int] = field(default_factory=set)  # flat K/V slots written so far

    def kv_slot(self, position: int, page_size: int) -> int:
        return self.pages[position // page_size] * page_size + position % page_size


def scattered_pages(num_seqs: int, pages_per_seq: int, num_pages: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled page lists (so a sequence's pages are neither contiguous nor ordered)."""
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(num_seqs)]


def make_batch(entries: list[tuple[Seq, Tensor]], page_size: int, max_pages: int, device: torch.device,
               is_verify: bool = False, pad_rows: int = 0, positions_from: list[int] | None = None,
               host_max_query_len: bool = True) -> ForwardBatch:
    """The rows ``tokens`` of each sequence at positions ``seq.length ..`` (or ``positions_from``).

    Every row gets logits. ``pad_rows`` > 0 appends a padding sequence (PAD_SLOT everywhere).
    Does not advance ``seq.length``; records the K/V slots written in ``seq.written``.
    ``host_max_query_len=False`` leaves ``max_query_len`` for the model to read from ``cu_seqlens``.
    """
    token_ids, positions, slots, tables, lens, cu = [], [], [], [], [], [0]
    for i, (seq, tokens) in enumerate(entries):
        start = seq.length if positions_from is None else positions_from[i]
        pos = list(range(start, start + tokens.shape[0]))
        token_ids.append(tokens)
        positions += pos
        slots += [seq.kv_slot(p, page_size) for p in pos]
        seq.written.update(slots[-len(pos):])
        tables.append(seq.pages + [-1] * (max_pages - len(seq.pages)))
        lens.append(start + tokens.shape[0])
        cu.append(cu[-1] + tokens.shape[0])
    state_slots = [seq.slot for seq, _ in entries]
    if pad_rows:
        token_ids.append(torch.zeros(pad_rows, dtype=torch.long))
        positions += list(range(pad_rows))
        slots += [PAD_SLOT] * pad_rows
        tables.append([-1] * max_pages)
        lens.append(0)
        cu.append(cu[-1] + pad_rows)
        state_slots.append(PAD_SLOT)
    num_rows = cu[-1]
    longs = dict(dtype=torch.long, device=device)
    return ForwardBatch(
        token_ids=torch.cat(token_ids).to(device), positions=torch.tensor(positions, **longs),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device), state_slots=torch.tensor(state_slots, **longs),
        kv_slot_mapping=torch.tensor(slots, **longs),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(lens, **longs), is_verify=is_verify, logits_rows=torch.arange(num_rows, **longs),
        max_query_len=max(b - a for a, b in zip(cu[:-1], cu[1:])) if host_max_query_len else None)


def row_bytes(t: Tensor) -> Tensor:
    """The raw bytes of each leading-axis row, ``[rows, bytes]`` (NaN-safe equality)."""
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(t.shape[0], -1).clone()


def changed_rows(before: Tensor, after: Tensor) -> set[int]:
    return set(torch.nonzero((before != after).any(dim=1)).flatten().tolist())
