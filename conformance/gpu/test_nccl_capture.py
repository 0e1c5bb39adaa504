"""The raw NCCL communicator (fast/parallel/nccl.py) on one GPU: eager collectives, and collectives captured in a
CUDA graph replayed on new inputs (what a tensor-parallel rank's captured target forward does).

One rank is all a one-GPU machine can run (NCCL refuses two ranks on one device), so the sums are over one rank:
exact copies. What this checks is the binding itself (library found, signatures, the unique id over a gloo group,
dtypes, the current stream) and that a captured ncclAllReduce / ncclAllGather replays with the graph, reading the
static input each time; the sums over several ranks are the multi-GPU run's (issue 36).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from dflash2.fast.parallel.nccl import NcclComm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.fixture
def comm():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        c = NcclComm.create(0, 1, torch.device("cuda", torch.cuda.current_device()))
        yield c
        c.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_collectives(comm, dtype):
    assert comm.version() >= 20906  # collectives are capturable from NCCL 2.9.6 on
    x = torch.randn(5, 7, dtype=dtype, device=comm.device)
    expected = x.clone()
    assert comm.all_reduce(x) is x and torch.equal(x, expected)
    gathered = comm.all_gather(x)
    assert gathered.shape == (1, 5, 7) and torch.equal(gathered[0], expected)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(x.t())
    with pytest.raises(TypeError, match="dtype"):
        comm.all_reduce(torch.zeros(3, dtype=torch.complex64, device=comm.device))


def test_collectives_replay_in_a_cuda_graph(comm):
    x = torch.zeros(64, 32, device=comm.device)
    stream = torch.cuda.Stream(comm.device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a warm-up run before the capture, as CapturedStep does
        y = comm.all_reduce(x * 2)
        z = comm.all_gather(y)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = comm.all_reduce(x * 2)
        z = comm.all_gather(y + 1)
    for seed in range(3):
        x.copy_(torch.randn(64, 32, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x * 2) and torch.equal(z[0], x * 2 + 1)
