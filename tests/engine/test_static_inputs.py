"""StaticInputs: the fields' device views and pinned host twins, uploaded whole or in two parts.

A captured DFlash step uploads the proposal's fields first and the rest of the batch after the
proposal's graphs are launched (fast/engine/graph_step.StepGraphs); these tests hold the two parts to
exactly the bytes of their fields, on the CPU (the device buffers are CPU tensors here).
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch

from dflash2.fast.engine.graphs.step_buffers import PROPOSAL_FIELDS, GraphKey, StaticInputs, field_sizes

SIZES = field_sizes(GraphKey(num_seqs=3, rows_per_seq=2, pages=5, is_verify=True), decode=False)
EARLY = PROPOSAL_FIELDS


def make(early=EARLY) -> StaticInputs:
    return StaticInputs(SIZES, torch.device("cpu"), early=early)


def present(inputs: StaticInputs) -> dict[str, torch.Tensor]:
    return {f.name: getattr(inputs.device, f.name) for f in fields(inputs.device)
            if getattr(inputs.device, f.name) is not None}


def fill(inputs: StaticInputs, value: float) -> None:
    host = inputs.begin_fill()
    for name in present(inputs):
        getattr(host, name)[:] = value + len(name)


def byte_range(view: torch.Tensor) -> tuple[int, int]:
    start = view.storage_offset() * view.element_size()
    return start, start + view.numel() * view.element_size()


def test_the_fields_are_typed_and_the_absent_ones_none():
    inputs = make()
    assert set(present(inputs)) == set(SIZES)
    assert inputs.device.tokens is None and inputs.host.sample_positions is None
    assert inputs.device.anchors.dtype == torch.long and inputs.device.top_p.dtype == torch.float32
    assert inputs.host.anchors.dtype == np.int64 and inputs.host.top_p.dtype == np.float32
    with pytest.raises(ValueError, match="keep"):
        StaticInputs({"keep": 1}, torch.device("cpu"))


def test_early_fields_lead_the_buffer_and_fields_do_not_overlap():
    inputs = make()
    ranges = {name: byte_range(view) for name, view in present(inputs).items()}
    assert max(ranges[n][1] for n in EARLY) <= min(r[0] for n, r in ranges.items() if n not in EARLY)
    spans = sorted(ranges.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert all(lo % 8 == 0 for lo, _ in spans), "a field is not 8-byte aligned"


def test_early_then_late_uploads_copy_exactly_their_fields():
    inputs = make()
    fill(inputs, 100.0)
    inputs.upload("early")
    late = tuple(n for n in SIZES if n not in EARLY)
    for name in EARLY:
        assert torch.equal(getattr(inputs.device, name), torch.from_numpy(getattr(inputs.host, name))), name
    for name in late:
        assert not getattr(inputs.device, name).any(), f"{name} was copied with the early part"
    inputs.upload("late")
    for name in EARLY + late:
        assert torch.equal(getattr(inputs.device, name), torch.from_numpy(getattr(inputs.host, name))), name
    fill(inputs, 7.0)
    inputs.upload("late")
    assert (inputs.device.anchors == 100 + len("anchors")).all(), "a late upload rewrote an early field"
    assert (inputs.device.top_p == 100 + len("top_p")).all(), "a late upload rewrote an early field"
    assert (inputs.device.block_tables == 7 + len("block_tables")).all()


def test_without_early_fields_the_upload_is_whole():
    inputs = make(early=())
    fill(inputs, 1.0)
    inputs.upload()
    for name, view in present(inputs).items():
        assert np.array_equal(view.numpy(), getattr(inputs.host, name)), name


def test_field_sizes_follow_the_key():
    key = GraphKey(num_seqs=4, rows_per_seq=8, pages=16, is_verify=True)
    decode, step = field_sizes(key, decode=True), field_sizes(key, decode=False)
    assert decode["positions"] == 32 and decode["block_tables"] == 64 and decode["tokens"] == 32
    assert "anchors" in step and "tokens" not in step and "anchors" not in decode
    # a speculative step's rows are derived on the device from its anchors (step_buffers.speculative_rows)
    assert {"positions", "kv_slot_mapping", "context_lens"} & set(step) == set()
    assert step["draft_limits"] == 4


def test_speculative_rows_on_the_device_are_the_host_fill():
    """``speculative_rows`` (a speculative step's positions, K/V slots and context lengths, derived in the step from
    its anchors) equals ``fill_batch``'s host fields for the same requests: 3 real requests in a bucket of 4, one
    near its end whose last rows pass its pages (they write nothing) and one whose rows pass the table's width."""
    from dflash2.fast.engine.graphs.step_buffers import fill_batch, fill_tables, fill_values, speculative_rows
    from dflash2.fast.model.batch import PAD_SLOT

    key = GraphKey(num_seqs=4, rows_per_seq=4, pages=3, is_verify=True)
    page_size, anchors, slots = 4, [2, 7, 10], [5, 0, 3]
    tables = [[8, 2], [1, 4], [6, 7, 9]]  # request 0 holds positions < 8; request 2 rows 10..13 pass 3 * 4 = 12
    host = StaticInputs(field_sizes(key, decode=True), torch.device("cpu")).host
    fill_batch(host, key, starts=anchors, slots=slots, tables=tables, logits_rows=range(12), page_size=page_size)
    inputs = StaticInputs(field_sizes(key, decode=False), torch.device("cpu"), early=EARLY)
    spec = inputs.begin_fill()
    fill_values(spec.anchors, anchors, 0)
    fill_values(spec.state_slots, slots, PAD_SLOT)
    fill_tables(spec, key, tables)
    inputs.upload()
    positions, kv_slots, context_lens = speculative_rows(inputs.device, key, page_size)
    assert positions.tolist() == host.positions.tolist()
    assert kv_slots.tolist() == host.kv_slot_mapping.tolist()
    assert context_lens.tolist() == host.context_lens.tolist() == [6, 11, 12, 0]
    assert kv_slots.tolist()[:4] == [34, 35, 8, 9] and kv_slots.tolist()[8:12] == [38, 39, PAD_SLOT, PAD_SLOT]
    assert spec.block_tables.tolist() == host.block_tables.tolist()
