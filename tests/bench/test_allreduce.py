"""bench/allreduce.py on the CPU: two spawned gloo ranks time all-reduces at each asked size; the bus bandwidth is
the algorithm bandwidth times 2 (N-1)/N; bad arguments are refused naming the value."""

from __future__ import annotations

import pytest
import torch

from dflash2.bench.allreduce import AllReduceBandwidth, bus_factor, measure_allreduce


def test_two_gloo_ranks_measure_a_positive_bandwidth_at_every_size():
    sizes = [160, 2048, 1 << 20]
    bw = measure_allreduce(2, "cpu", sizes + [2048], torch.float32, reps=3)
    assert bw.tp == 2 and bw.backend == "gloo" and bw.dtype == "float32" and sorted(bw.seconds) == sizes
    for size in sizes:
        assert bw.seconds[size] > 0 and bw.algbw(size) == size / bw.seconds[size]
        assert bw.busbw(size) == bw.algbw(size)  # 2 (N-1)/N = 1 at N = 2
    assert [m["bytes"] for m in bw.to_json()["sizes"]] == sizes
    with pytest.raises(KeyError, match="size=99 bytes: not measured"):
        bw.busbw(99)


def test_the_bus_factor():
    assert [bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    bw = AllReduceBandwidth(tp=4, backend="nccl", dtype="bfloat16", seconds={1000: 1e-6})
    assert bw.algbw(1000) == pytest.approx(1e9) and bw.busbw(1000) == pytest.approx(1.5e9)


@pytest.mark.parametrize("args, match", [
    ((1, "cpu", [64]), "tp=1"),
    ((2, "tpu", [64]), "device_type='tpu'"),
    ((2, "cpu", [6]), r"sizes=\[6\]"),
])
def test_refusals(args, match):
    with pytest.raises(ValueError, match=match):
        measure_allreduce(*args, torch.float32)
