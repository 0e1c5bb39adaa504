"""Measuring on the GPU, shared by ``ft bench`` and the kernel micro-benchmarks (bench/kernels/)."""

from __future__ import annotations

import statistics

import torch


def copy_bandwidth(device: torch.device | str = "cuda", num_bytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of ``reps`` timed copies."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    median = cuda_time(lambda: dst.copy_(src), reps=reps, warmup=0)
    return 2 * src.numel() * src.element_size() / median


def matmul_rate(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16, size: int = 8192,
                reps: int = 20) -> float:
    """Dense matmul rate in FLOP/s on a CUDA device: ``2 size^3`` over the median of ``reps`` timed
    ``[size, size] @ [size, size]`` products in ``dtype`` (random normal operands, torch's cuBLAS GEMM), after 5
    warm-up products."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}: matmul_rate times CUDA events, expected a CUDA device")
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    out = torch.empty(size, size, device=device, dtype=dtype)
    median = cuda_time(lambda: torch.mm(a, b, out=out), reps=reps, warmup=5)
    return 2 * size ** 3 / median


def cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` between CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` warmed up twice on a side stream (compiles, workspaces), then captured as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_seconds(fn, reps: int = 20) -> float:
    """CUDA-event median of CUDA-graph replays of ``fn`` (:func:`capture_graph`)."""
    return cuda_time(capture_graph(fn).replay, reps=reps)


def graph_replay_us(fn, calls: int = 1) -> float:
    """Device microseconds per call of a CUDA graph of ``fn`` (:func:`capture_graph`) making ``calls``
    calls: the median of triton's ``do_bench`` over replays, which flushes the L2 between them (the
    kernel micro-benchmarks' measure: back-to-back launches as a captured step runs them)."""
    from triton.testing import do_bench  # the GPU machine's; ft bench itself does not need it

    return do_bench(capture_graph(fn).replay, warmup=10, rep=60, return_mode="median") * 1e3 / calls


def rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """rms(a - b) / rms(b) in float64 (docs/tolerances.md, NUMERIC)."""
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
