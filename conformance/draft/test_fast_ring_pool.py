"""RingPool and WindowPool (all slots at once) against one reference Ring per slot, step by step.

Every operation goes to the fast pools and to the reference rings (``reference/speculative/ring.py``, itself
checked against an obvious model in tests/speculative/ring); after each step every slot's read at its
frontier must agree: positions and tags EXACT, rows bitwise (the pools only store). Writes batch
the rows of several slots (and padding rows) into one call, as an engine step does; a prefill
may exceed the capacity in one call; a snapshot saves a slot's window (``WindowPool.save``), a restore
loads it into another slot and rebuilds that slot's ring from it. The K/V of a context row is a fixed function of the row
(``kv_of``), standing in for the draft's projection. A planted off-by-one ring index must fail.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from dflash2.fast.model.batch import PAD_SLOT
from dflash2.fast.speculative.ring import RingPool, StaleSlotError, WindowPool
from dflash2.reference.speculative.ring import Ring

NUM_SLOTS, WINDOW, MARGIN = 3, 6, 3
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 2, 1, 2, 3


def kv_of(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic stand-in for the draft's context K/V  # rows [N, C] -> k, v [L, N, Hkv, D]."""
    base = rows[:, :HEAD_DIM].reshape(-1, KV_HEADS, HEAD_DIM)
    return torch.stack([base * (layer + 2) for layer in range(LAYERS)]), torch.stack(
        [base + (layer + 1) for layer in range(LAYERS)])


class PoolModel(RuleBasedStateMachine):
    ring_cls = RingPool

    def __init__(self):
        super().__init__()
        self.ring = self.ring_cls(NUM_SLOTS, WINDOW, LAYERS, KV_HEADS, HEAD_DIM, margin=MARGIN, poison=True)
        self.window = WindowPool(NUM_SLOTS, WINDOW, HIDDEN, margin=MARGIN, poison=True, num_saved=1)
        self.ref_rows = [Ring(WINDOW, (HIDDEN,), margin=MARGIN) for _ in range(NUM_SLOTS)]
        self.frontier = [0] * NUM_SLOTS
        self.ahead = [0] * NUM_SLOTS  # rows written at frontier.. since the frontier last moved
        self.next_id = 0

    def fresh(self, slot: int, positions: list[int]) -> torch.Tensor:
        self.next_id += 1
        return torch.tensor([[self.next_id * 1000.0 + p, slot, j] for p in positions for j in (0.5,)])

    def write(self, plan: list[tuple[int, int]], pad_rows: int = 0) -> None:
        """One batched call: ``count`` rows at the frontier of each (slot, count), then padding rows."""
        slots, positions, rows = [], [], []
        for slot, count in plan:
            pos = list(range(self.frontier[slot], self.frontier[slot] + count))
            r = self.fresh(slot, pos)
            self.ref_rows[slot].write(torch.tensor(pos), r)
            slots += [slot] * count
            positions += pos
            rows.append(r)
        slots += [PAD_SLOT] * pad_rows
        positions += list(range(pad_rows))
        rows.append(torch.full((pad_rows, HIDDEN), float("nan")))
        slots_t, positions_t, rows_t = torch.tensor(slots, dtype=torch.long), torch.tensor(positions), torch.cat(rows)
        self.window.write(slots_t, positions_t, rows_t)
        k, v = kv_of(rows_t)
        self.ring.write(slots_t, positions_t, k, v)

    @rule(data=st.data(), pad_rows=st.integers(0, 2))
    def step(self, data, pad_rows):
        """An engine step: some slots prefill (any length, committed), others verify (<= M+1 rows ahead)."""
        plan, commits = [], []
        for slot in data.draw(st.lists(st.integers(0, NUM_SLOTS - 1), min_size=1, max_size=NUM_SLOTS, unique=True)):
            if data.draw(st.booleans(), label="prefill"):
                n = data.draw(st.integers(1, 30), label="n")
                plan.append((slot, n))
                commits.append((slot, n))
            else:
                plan.append((slot, data.draw(st.integers(1, MARGIN + 1), label="verify rows")))
        self.write(plan, pad_rows)
        for slot, count in plan:
            self.ahead[slot] = count
        for slot, n in commits:
            self.commit(slot, n)

    def commit(self, slot: int, count: int) -> None:
        self.frontier[slot] += count
        self.ahead[slot] = 0

    @rule(data=st.data())
    def accept(self, data):
        """The rows a slot wrote ahead: the first a+1 of them committed (a verify's acceptance)."""
        slot = data.draw(st.integers(0, NUM_SLOTS - 1))
        if self.ahead[slot]:
            self.commit(slot, data.draw(st.integers(1, self.ahead[slot]), label="committed"))

    @rule(src=st.integers(0, NUM_SLOTS - 1), dst=st.integers(0, NUM_SLOTS - 1))
    def snapshot_and_restore(self, src, dst):
        """Save src's window in a snapshot slot, load it into dst, then rebuild dst's ring at src's frontier."""
        f = self.frontier[src]
        self.window.save(torch.tensor([src]), torch.tensor([0]))
        self.window.load(torch.tensor([0]), torch.tensor([dst]))
        positions, rows, valid = self.window.read(torch.tensor([dst]), torch.tensor([f]))
        k, v = kv_of(rows[0])
        self.ring.rebuild(torch.tensor([dst]), positions, k[:, None], v[:, None], valid)
        ref_positions, ref_rows = self.ref_rows[src].read(f)
        restored = Ring(WINDOW, (HIDDEN,), margin=MARGIN)
        restored.rebuild(ref_positions, ref_rows)
        self.ref_rows[dst] = restored
        self.frontier[dst], self.ahead[dst] = f, 0

    @invariant()
    def reads_equal_the_reference(self):
        slots, anchors = torch.arange(NUM_SLOTS), torch.tensor(self.frontier)
        self.ring.check_readable(slots, anchors)
        self.window.check_readable(slots, anchors)
        positions, rows, valid = self.window.read(slots, anchors)
        for slot in range(NUM_SLOTS):
            ref_positions, ref_rows = self.ref_rows[slot].read(self.frontier[slot])
            assert torch.equal(positions[slot][valid[slot]], ref_positions)
            assert torch.equal(rows[slot][valid[slot]], ref_rows)
            k, v = kv_of(ref_rows)
            for layer in range(LAYERS):
                ring_k, ring_v, ring_valid = self.ring.gather(layer, slots, anchors)
                assert torch.equal(ring_valid, valid)
                assert torch.equal(ring_k[slot][valid[slot]], k[layer])
                assert torch.equal(ring_v[slot][valid[slot]], v[layer])


TestRingPool = PoolModel.TestCase
TestRingPool.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])


class OffByOneIndex(RingPool):
    def write(self, slots, positions, k, v):
        rows, index, source = self._targets(slots, positions)
        index = (index + 1) % self.capacity  # planted: every row one ring row late, tags included
        self.k[:, rows, index] = k[:, source]
        self.v[:, rows, index] = v[:, source]
        self.tags[rows, index] = positions[source]


def test_planted_off_by_one_ring_index_fails():
    machine = type("PlantedOffByOne", (PoolModel,), {"ring_cls": OffByOneIndex})
    quick = settings(max_examples=100, stateful_step_count=20, deadline=None, database=None,
                     phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    with pytest.raises((AssertionError, StaleSlotError)):
        run_state_machine_as_test(machine, settings=quick)
