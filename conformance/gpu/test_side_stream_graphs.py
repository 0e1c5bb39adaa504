"""The side stream (fast/model/side_stream.py) inside CUDA-graph captures, on a GPU.

EXACT: split-K ``skinny_linear`` calls (ticket counters) on the side stream beside split-K calls on the
capture's own stream, forked, cut into a second graph (the cut joins the fork first) and joined: every
replay gives the eager calls' bits, both lanes' counters are zero after, and the side calls used lane 1.
The engine's use of it (a captured DFlash step observing from the last tap on) is held to the eager
engine's tokens by test_cuda_graphs.py.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.model.side_stream import SIDE_LANE, SideStream
from dflash2.fast.kernels.common import tickets
from dflash2.fast.kernels.dense.skinny_linear import SkinnyConfig, skinny_linear_triton
from dflash2.fast.model import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPLIT = SkinnyConfig(block_n=16, block_k=128, split_k=4)


def _step(side: SideStream, x, w_main, w_side, out: dict) -> None:
    """main: two split-K GEMMs, a cut, one more; side (forked after the first): three, with a torch op between."""
    out["a"] = skinny_linear_triton(x, w_main, config=SPLIT)

    def side_work():
        h = skinny_linear_triton(x, w_side, config=SPLIT)
        h = skinny_linear_triton(torch.relu(h), w_main, config=SPLIT)
        out["s"] = skinny_linear_triton(h, w_side, config=SPLIT)

    side.fork(side_work)
    out["b"] = skinny_linear_triton(out["a"], w_side, config=SPLIT)
    capture.graph_cut()  # in a capture: joins the fork, then ends the first graph
    out["c"] = skinny_linear_triton(out["b"] + 1.0, w_main, config=SPLIT)
    side.join()


def test_forked_split_k_work_replays_exactly_across_a_cut():
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, 1024, device=device, generator=gen, dtype=torch.bfloat16)
    w_main = torch.randn(1024, 1024, device=device, generator=gen, dtype=torch.bfloat16) / 32
    w_side = torch.randn(1024, 1024, device=device, generator=gen, dtype=torch.bfloat16) / 32
    side = SideStream(device)
    eager: dict = {}
    _step(side, x, w_main, w_side, eager)  # also makes both lanes' counter buffers, before any capture
    torch.cuda.synchronize()
    device = x.device  # cuda:0, the key the counters are kept under
    assert (device, SIDE_LANE) in tickets._COUNTERS and (device, 0) in tickets._COUNTERS

    captured: dict = {}
    graphs: list[torch.cuda.CUDAGraph] = []
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))

    def begin():
        graphs.append(torch.cuda.CUDAGraph())
        graphs[-1].capture_begin()

    def cut(mark):
        graphs[-1].capture_end()
        begin()

    with torch.cuda.stream(stream):
        begin()
        with capture.cutting(cut):
            _step(side, x, w_main, w_side, captured)
        graphs[-1].capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    assert len(graphs) == 2
    for _ in range(5):
        for name in captured:
            captured[name].fill_(float("nan"))
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        for name in ("a", "b", "c", "s"):
            assert torch.equal(captured[name], eager[name]), name
        for key in ((device, 0), (device, SIDE_LANE)):
            assert not tickets._COUNTERS[key].any(), key
