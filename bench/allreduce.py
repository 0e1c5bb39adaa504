"""The all-reduce bandwidth of ``tp`` ranks, measured by ``ft bench --tp N`` before its engines start (the second term
of the tensor-parallel floor, bench/floors.py).

N processes are spawned (``torch.multiprocessing``, spawn) and join one group the way the engine's ranks do
(fast/engine/tp/workers.py): NCCL on CUDA with rank r on ``cuda:r``, gloo on the CPU. The parent joins no group, so
the engine it builds next starts its own. For each message size (bytes), every rank times ``all_reduce(SUM)`` of a
zero tensor of that many bytes in the run's dtype (zeros: repeated sums stay finite): 3 calls of warm-up (NCCL builds
its communicator on the first), then ``reps`` timings of ``inner`` back-to-back calls between a barrier and a device
synchronisation, each the slowest rank's (an all-reduce ends when the last rank's does); ``t`` is their median over
``inner``. Then

    algorithm bandwidth  algbw = size / t
    bus bandwidth        busbw = algbw x 2 (N - 1) / N

busbw is nccl-tests' figure: the bytes a ring all-reduce moves through each rank's link per second, comparable to
the link's peak and across N. The floor divides ring bus bytes by it. Each call is an eager ``dist.all_reduce`` from
Python, so a small message's time is mostly latency: its busbw is far below the 16 MiB figure, which is why each
step's collectives are measured at their own sizes. The engine's CUDA ranks call NCCL directly
(fast/parallel/nccl.py), inside CUDA graphs for decode and verify forwards, so they pay less host latency per
collective than measured here: for those steps the all-reduce term overestimates, so their share of the floor
flatters them.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PEAK_BYTES = 16 << 20  # the large-message figure reported beside the copy bandwidth
WARMUP = 3


def bus_factor(tp: int) -> float:
    """Bus bytes over message bytes of a ring all-reduce on ``tp`` ranks: ``2 (tp - 1) / tp``."""
    return 2 * (tp - 1) / tp


@dataclass(frozen=True)
class AllReduceBandwidth:
    """What :func:`measure_allreduce` measured: ``seconds[size]`` per all-reduce of ``size`` bytes on ``tp`` ranks."""

    tp: int
    backend: str  # nccl | gloo
    dtype: str
    seconds: dict[int, float]

    def algbw(self, size: int) -> float:
        """Bytes/s: ``size / t(size)``."""
        return size / self._seconds(size)

    def busbw(self, size: int) -> float:
        """Bytes/s: ``algbw x 2 (tp - 1) / tp`` (module docstring)."""
        return self.algbw(size) * bus_factor(self.tp)

    def _seconds(self, size: int) -> float:
        if size not in self.seconds:
            raise KeyError(f"all-reduce message size={size} bytes: not measured (measured: {sorted(self.seconds)})")
        return self.seconds[size]

    def to_json(self) -> dict:
        return {"tp": self.tp, "backend": self.backend, "dtype": self.dtype, "peak_bytes": PEAK_BYTES,
                "sizes": [{"bytes": size, "us": 1e6 * t, "algbw_GBps": self.algbw(size) / 1e9,
                           "busbw_GBps": self.busbw(size) / 1e9} for size, t in sorted(self.seconds.items())]}


def measure_allreduce(tp: int, device_type: str, sizes: Iterable[int], dtype: torch.dtype = torch.float32,
                      reps: int = 10) -> AllReduceBandwidth:
    """Spawn ``tp`` ranks on ``device_type`` ('cuda': NCCL, rank r on cuda:r; 'cpu': gloo), time an all-reduce of
    each of ``sizes`` bytes (each a multiple of the dtype's itemsize) and return the times (module docstring)."""
    if not isinstance(tp, int) or tp < 2:
        raise ValueError(f"tp={tp!r}: expected an integer >= 2 (one rank has nothing to all-reduce)")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type={device_type!r}: expected 'cuda' or 'cpu'")
    if device_type == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(f"tp={tp}: expected at most the {torch.cuda.device_count()} visible CUDA devices")
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = sorted(set(sizes))
    bad = [s for s in sizes if s < itemsize or s % itemsize]
    if bad:
        raise ValueError(f"sizes={bad}: expected positive multiples of {dtype}'s {itemsize} bytes")
    queue = mp.get_context("spawn").SimpleQueue()
    # join=True: a rank that raises is reported here (torch's ProcessRaisedException) after the others are ended
    mp.start_processes(_rank_main, args=(tp, _free_port(), device_type, sizes, dtype, reps, queue), nprocs=tp,
                       join=True, start_method="spawn")
    seconds = queue.get()  # rank 0's put: a few floats, well inside the pipe's buffer, so its put never blocks
    return AllReduceBandwidth(tp, "nccl" if device_type == "cuda" else "gloo", str(dtype).removeprefix("torch."),
                              dict(zip(sizes, seconds)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tp: int, port: int, device_type: str, sizes: list[int], dtype: torch.dtype, reps: int,
               queue) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device, backend, sync = torch.device("cuda", rank), "nccl", torch.cuda.synchronize
    else:  # the CPU's cores shared out, as the engine's CPU ranks do
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
        device, backend, sync = torch.device("cpu"), "gloo", (lambda: None)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_size = []
        for size in sizes:
            x = torch.zeros(size // itemsize, dtype=dtype, device=device)
            inner = max(1, min(20, (4 << 20) // size))  # enough calls that a small message's time is not one timer tick
            per_size.append(_time(x, reps, inner, sync))
        times = torch.tensor(per_size, dtype=torch.float64, device=device)  # [sizes, reps] seconds per call
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each timing is its slowest rank's
        if rank == 0:
            queue.put([statistics.median(row) for row in times.tolist()])
    finally:
        dist.destroy_process_group()


def _time(x: torch.Tensor, reps: int, inner: int, sync) -> list[float]:
    """``reps`` timings of ``inner`` all-reduces of ``x``, seconds per call."""
    for _ in range(WARMUP):
        dist.all_reduce(x)
    sync()
    out = []
    for _ in range(reps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            dist.all_reduce(x)
        sync()
        out.append((time.perf_counter() - start) / inner)
    return out
