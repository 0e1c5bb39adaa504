"""Named boundary scenarios of the ring, at the released size (W = 2048, margin 64) and at small W."""

from __future__ import annotations

import pytest
import torch

from dflash2.reference.speculative.ring import RING_MARGIN, Ring, StaleSlotError

W = 2048


def rows_for(positions, tag: int = 0) -> torch.Tensor:
    """One distinguishable row per position: [position, tag]  # [T, 2]."""
    positions = torch.as_tensor(positions, dtype=torch.float32)
    return torch.stack([positions, torch.full_like(positions, float(tag))], dim=1)


def span(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.long)


def assert_reads(ring: Ring, anchor: int, committed: dict[int, torch.Tensor]) -> None:
    positions, rows = ring.read(anchor)
    want = list(range(max(0, anchor - ring.window + 1), anchor))
    assert positions.tolist() == want
    if want:
        assert torch.equal(rows, torch.stack([committed[p] for p in want]))


def prefill(ring: Ring, committed: dict, start: int, stop: int, tag: int = 0) -> None:
    rows = rows_for(span(start, stop), tag)
    ring.write(span(start, stop), rows)
    committed.update(zip(range(start, stop), rows))


def test_released_capacity():
    ring = Ring(W, (2,))
    assert ring.capacity == 2112 == W + RING_MARGIN
    assert ring.slot(torch.tensor([0, 2111, 2112, 5000])).tolist() == [0, 2111, 0, 5000 % 2112]


def test_wrap_past_capacity():
    ring, committed = Ring(W, (2,)), {}
    prefill(ring, committed, 0, 3 * 2112 + 17)  # one write longer than the ring: later rows win
    f = 3 * 2112 + 17
    assert_reads(ring, f, committed)
    for step in range(450):  # then decode-like steps of 8 rows, 5 kept
        ring.write(span(f, f + 8), rows_for(span(f, f + 8), tag=step))
        committed.update(zip(range(f, f + 5), rows_for(span(f, f + 5), tag=step)))
        f += 5
        if step % 9 == 0:  # every 45 positions, many times per lap of 2112
            assert_reads(ring, f, committed)
    assert_reads(ring, f, committed)
    assert f > 4 * 2112


@pytest.mark.parametrize("anchor,count", [(0, 0), (1, 1), (W - 1, W - 1), (W, W - 1), (W + 1, W - 1), (5000, W - 1)])
def test_exactly_w_minus_one_readable_rows(anchor, count):
    ring, committed = Ring(W, (2,)), {}
    prefill(ring, committed, 0, anchor)
    positions, rows = ring.read(anchor)
    assert positions.numel() == rows.shape[0] == count
    if count:
        assert positions[0] == anchor - count and positions[-1] == anchor - 1
    assert_reads(ring, anchor, committed)


def test_65_rows_past_the_frontier_keep_every_readable_slot():
    ring, committed = Ring(W, (2,)), {}
    f = 3000
    prefill(ring, committed, 0, f)
    past = span(f, f + RING_MARGIN + 1)  # f .. f+64: 65 rows, none committed
    assert past.numel() == 65
    ring.write(past, rows_for(past, tag=9))
    assert_reads(ring, f, committed)
    # any acceptance of a prefix of them keeps the invariant at the new frontier
    for kept in (1, 30, 65):
        committed.update(zip(range(f, f + kept), rows_for(span(f, f + kept), tag=9)))
        assert_reads(ring, f + kept, committed)


def test_a_66th_row_past_the_frontier_aliases_the_oldest_readable_slot():
    ring, committed = Ring(W, (2,)), {}
    f = 3000
    prefill(ring, committed, 0, f)
    ring.write(span(f, f + RING_MARGIN + 2), rows_for(span(f, f + RING_MARGIN + 2), tag=9))  # f .. f+65
    with pytest.raises(StaleSlotError, match=f"position {f - W + 1} holds position {f + RING_MARGIN + 1}"):
        ring.read(f)


def test_every_draft_rejected():
    ring, committed = Ring(W, (2,)), {}
    s, k = 2500, 7
    prefill(ring, committed, 0, s)
    ring.write(span(s, s + k + 1), rows_for(span(s, s + k + 1), tag=1))  # verify rows s..s+7
    committed[s] = rows_for([s], tag=1)[0]  # num_accepted 0: only the anchor's row is committed
    s += 1
    assert_reads(ring, s, committed)
    # the next verify overwrites the rejected rows; after it, reads still match the model
    ring.write(span(s, s + k + 1), rows_for(span(s, s + k + 1), tag=2))
    committed.update(zip(range(s, s + 3), rows_for(span(s, s + 3), tag=2)))
    s += 3
    assert_reads(ring, s, committed)


def test_never_written_and_stale_slots_raise():
    ring = Ring(8, (2,), margin=2)
    with pytest.raises(StaleSlotError, match="never written"):
        ring.read(3)
    ring.write(span(0, 30), rows_for(span(0, 30)))
    ring.read(30)
    with pytest.raises(StaleSlotError, match="holds position"):
        ring.read(20)  # position 13's slot now holds 23


def live_run(ring: Ring, steps: int, seed: int) -> tuple[int, dict]:
    """A prompt, then verify steps with random acceptances; returns (frontier, committed rows)."""
    gen = torch.Generator().manual_seed(seed)
    committed: dict[int, torch.Tensor] = {}
    f = 1500
    prefill(ring, committed, 0, f)
    for step in range(steps):
        k = int(torch.randint(1, 8, (1,), generator=gen))
        ring.write(span(f, f + k + 1), rows_for(span(f, f + k + 1), tag=step + 1))
        kept = int(torch.randint(0, k + 1, (1,), generator=gen)) + 1
        committed.update(zip(range(f, f + kept), rows_for(span(f, f + kept), tag=step + 1)))
        f += kept
    return f, committed


@pytest.mark.parametrize("extra", [0, 64])
def test_rebuild_equals_live_state(extra):
    live = Ring(W, (2,))
    f, committed = live_run(live, steps=300, seed=0)
    window = list(range(f - (W - 1) - extra, f))  # the snapshot's window (longer than W-1 if extra)
    rebuilt = Ring(W, (2,))
    rebuilt.write(span(f, f + 8), rows_for(span(f, f + 8), tag=-1))  # garbage a rebuild must forget
    rebuilt.rebuild(torch.tensor(window), torch.stack([committed[p] for p in window]))
    for a, b in zip(live.read(f), rebuilt.read(f)):
        assert torch.equal(a, b)
    # and both continue identically
    for ring in (live, rebuilt):
        ring.write(span(f, f + 8), rows_for(span(f, f + 8), tag=7))
    for a, b in zip(live.read(f + 4), rebuilt.read(f + 4)):
        assert torch.equal(a, b)


def test_rebuild_of_a_short_context_and_bad_input():
    ring, committed = Ring(W, (2,)), {}
    prefill(ring, committed, 0, 100)
    ring.rebuild(span(0, 100), torch.stack([committed[p] for p in range(100)]))
    assert_reads(ring, 100, committed)
    with pytest.raises(ValueError, match="consecutive"):
        ring.rebuild(torch.tensor([0, 2]), rows_for([0, 2]))
    with pytest.raises(ValueError, match="rows"):
        ring.write(span(0, 3), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="margin"):
        Ring(8, (2,), margin=-1)
