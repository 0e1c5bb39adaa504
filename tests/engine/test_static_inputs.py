"""StaticInputs: the fields' device views and pinned host twins, uploaded whole or in two parts.

A captured DFlash step uploads the proposal's fields first and the rest of the batch after the
proposal's graphs are launched (fast/engine/graphs.StepGraphs); these tests hold the two parts to
exactly the bytes of their fields, on the CPU (the device buffers are CPU tensors here).
"""

from __future__ import annotations

import numpy as np
import torch

from dflash2.fast.engine.graphs import StaticInputs


def make() -> StaticInputs:
    return StaticInputs({"positions": 4, "anchors": 2, "block_tables": 3}, {"top_p": 2, "bias": 1},
                        torch.device("cpu"), early=("anchors", "top_p"))


def fill(inputs: StaticInputs, value: float) -> None:
    for name, field in inputs.begin_fill().items():
        field[:] = value + len(name)


def byte_range(inputs: StaticInputs, name: str) -> tuple[int, int]:
    view = inputs.views[name]
    start = view.storage_offset() * view.element_size()
    return start, start + view.numel() * view.element_size()


def test_early_fields_lead_the_buffer_and_fields_do_not_overlap():
    inputs = make()
    ranges = {name: byte_range(inputs, name) for name in inputs.views}
    assert max(ranges[n][1] for n in ("anchors", "top_p")) <= min(ranges[n][0] for n in ("positions", "block_tables",
                                                                                           "bias"))
    spans = sorted(ranges.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert all(lo % 8 == 0 for lo, _ in spans), "a field is not 8-byte aligned"
    assert inputs.views["anchors"].dtype == torch.long and inputs.views["top_p"].dtype == torch.float32
    assert inputs.host["anchors"].dtype == np.int64 and inputs.host["top_p"].dtype == np.float32


def test_early_then_late_uploads_copy_exactly_their_fields():
    inputs = make()
    fill(inputs, 100.0)
    inputs.upload("early")
    early, late = ("anchors", "top_p"), ("positions", "block_tables", "bias")
    for name in early:
        assert torch.equal(inputs.views[name], torch.from_numpy(inputs.host[name])), name
    for name in late:
        assert not inputs.views[name].any(), f"{name} was copied with the early part"
    inputs.upload("late")
    for name in early + late:
        assert torch.equal(inputs.views[name], torch.from_numpy(inputs.host[name])), name
    fill(inputs, 7.0)
    inputs.upload("late")
    assert (inputs.views["anchors"] == 100 + len("anchors")).all(), "a late upload rewrote an early field"
    assert (inputs.views["positions"] == 7 + len("positions")).all()


def test_without_early_fields_the_upload_is_whole():
    inputs = StaticInputs({"a": 3}, {"b": 2}, torch.device("cpu"))
    fill(inputs, 1.0)
    inputs.upload()
    assert np.array_equal(inputs.views["a"].numpy(), inputs.host["a"])
    assert np.array_equal(inputs.views["b"].numpy(), inputs.host["b"])
