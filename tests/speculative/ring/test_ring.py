"""The ring against an obvious model: a dict position -> the row last committed there.

Every operation goes to the ring and to the model; after each step the ring's read at the
frontier must equal the model. Operations are those of a request's life: prefills (rows written
and committed), verify writes (k+1 rows at f..f+k before acceptance is known), acceptances (the
frontier moves by num_accepted + 1), prefill rows written past a snapshot boundary without being
committed, reads at earlier anchors, and a prefix-cache rebuild from the last rows committed.
Planted bugs (an off-by-one modulus, a window one row too wide or reaching the anchor, a ring
that skips its tag check) must make this machine fail.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from dflash2.reference.speculative.ring import Ring, StaleSlotError

ROW_SHAPE = (2, 3)


class RingModel(RuleBasedStateMachine):
    """Ring (W, M) vs the model. Subclasses pick W, M and the ring class."""

    window, margin, ring_cls = 6, 3, Ring

    def __init__(self):
        super().__init__()
        self.ring = self.ring_cls(self.window, ROW_SHAPE, margin=self.margin)
        self.committed: dict[int, torch.Tensor] = {}  # position -> row last committed there
        self.written: dict[int, torch.Tensor] = {}  # position -> row last written at or past the frontier
        self.frontier = 0
        self.verify_k: int | None = None  # the pending verify's k, until its acceptance
        self.next_id = 0

    def fresh_rows(self, positions: list[int]) -> torch.Tensor:
        """Rows no other write has produced: (write id, position) in every entry  # [T, *ROW_SHAPE]."""
        self.next_id += 1
        rows = torch.empty((len(positions), *ROW_SHAPE))
        for j, p in enumerate(positions):
            rows[j] = self.next_id * 100_000 + p
        return rows

    def write_ahead(self, count: int) -> None:
        positions = list(range(self.frontier, self.frontier + count))
        rows = self.fresh_rows(positions)
        self.ring.write(torch.tensor(positions), rows)
        self.written.update(zip(positions, rows))

    def commit(self, count: int) -> None:
        for p in range(self.frontier, self.frontier + count):
            self.committed[p] = self.written.pop(p)
        self.frontier += count
        self.written = {p: r for p, r in self.written.items() if p >= self.frontier}

    def expected(self, anchor: int) -> tuple[list[int], list[torch.Tensor]]:
        positions = list(range(max(0, anchor - self.window + 1), anchor))
        return positions, [self.committed[p] for p in positions]

    def check_read(self, anchor: int) -> None:
        positions, rows = self.ring.read(anchor)
        want_positions, want_rows = self.expected(anchor)
        assert positions.tolist() == want_positions
        assert len(want_rows) == rows.shape[0]
        if want_rows:
            assert torch.equal(rows, torch.stack(want_rows)), f"anchor {anchor}: ring rows differ from the model"

    @rule(n=st.integers(1, 40))
    def prefill(self, n):
        """n prompt (or restored) rows at f..f+n-1, all committed; n may exceed the capacity."""
        self.write_ahead(n)
        self.commit(n)
        self.verify_k = None

    @rule(data=st.data())
    def verify_write(self, data):
        """A verify at anchor f writes k+1 rows f..f+k before acceptance is known (k+1 <= M+1)."""
        k = data.draw(st.integers(0, self.margin), label="k")
        self.write_ahead(k + 1)
        self.verify_k = k

    @precondition(lambda self: self.verify_k is not None)
    @rule(data=st.data())
    def accept(self, data):
        """num_accepted a <= k drafts kept: rows f..f+a committed, frontier to f+a+1."""
        num_accepted = data.draw(st.integers(0, self.verify_k), label="num_accepted")
        self.commit(num_accepted + 1)
        self.verify_k = None

    @rule(data=st.data())
    def prefill_past_boundary(self, data):
        """Rows f..f+m (m <= M) written ahead of a tracked boundary f and not committed."""
        m = data.draw(st.integers(0, self.margin), label="m")
        self.write_ahead(m + 1)
        self.verify_k = None

    @rule(back=st.integers(1, 30))
    def read_earlier_anchor(self, back):
        """An anchor before the frontier: either the model's rows or StaleSlotError, never wrong rows."""
        anchor = max(0, self.frontier - back)
        try:
            self.check_read(anchor)
        except StaleSlotError:
            pass

    @rule(extra=st.integers(0, 8))
    def rebuild(self, extra):
        """Prefix-cache restore from a snapshot window longer than W-1 by ``extra`` rows."""
        start = max(0, self.frontier - (self.window - 1) - extra)
        positions = list(range(start, self.frontier))
        if any(p not in self.committed for p in positions):  # rows lost before a rebuild started
            return
        rows = torch.stack([self.committed[p] for p in positions]) if positions else torch.empty((0, *ROW_SHAPE))
        before = self.ring.read(self.frontier)
        self.ring.rebuild(torch.tensor(positions, dtype=torch.long), rows)
        after = self.ring.read(self.frontier)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
        self.written = {}  # a restored request has nothing past its frontier
        self.verify_k = None

    @invariant()
    def read_at_frontier_equals_model(self):
        self.check_read(self.frontier)


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


class SmallRing(RingModel):
    window, margin = 6, 3


class WideMarginRing(RingModel):
    window, margin = 9, 8


class NoMarginRing(RingModel):
    window, margin = 4, 0


TestSmallRing = SmallRing.TestCase
TestSmallRing.settings = MACHINE_SETTINGS
TestWideMarginRing = WideMarginRing.TestCase
TestWideMarginRing.settings = MACHINE_SETTINGS
TestNoMarginRing = NoMarginRing.TestCase
TestNoMarginRing.settings = MACHINE_SETTINGS


# -- planted bugs: each must make the machine fail ------------------------------------------------

class ModulusOffByOne(Ring):
    def slot(self, positions):
        return positions % (self.capacity - 1)


class WindowOneTooWide(Ring):
    def readable_positions(self, anchor):
        return torch.arange(max(0, anchor - self.window), anchor, dtype=torch.long)


class WindowReachesAnchor(Ring):
    def readable_positions(self, anchor):
        return torch.arange(max(0, anchor - self.window + 2), anchor + 1, dtype=torch.long)


class UncheckedModulusOffByOne(ModulusOffByOne):
    """No tag check: the model comparison alone must catch the wrong rows."""

    def read(self, anchor):
        positions = self.readable_positions(anchor)
        return positions, self.rows[self.slot(positions)].clone()


@pytest.mark.parametrize("ring_cls", [ModulusOffByOne, WindowOneTooWide, WindowReachesAnchor,
                                      UncheckedModulusOffByOne])
def test_planted_ring_bug_fails_the_model_comparison(ring_cls):
    machine = type(f"Planted{ring_cls.__name__}", (SmallRing,), {"ring_cls": ring_cls})
    quick = settings(max_examples=300, stateful_step_count=40, deadline=None, database=None,
                     phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    with pytest.raises((AssertionError, StaleSlotError)):
        run_state_machine_as_test(machine, settings=quick)
