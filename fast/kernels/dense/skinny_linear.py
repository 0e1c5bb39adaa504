"""``x @ W.T`` for a few rows (the draft's block rows: 8 a request), twin of the plain matmul (torch form
``skinny_linear_torch``; reference: every ``x @ W.T`` of ``reference/model``, and ``mlp.swiglu``).

M rows, K inputs, N outputs; W ``[N, K]`` (or ``[2N, K]``, gate rows then up rows, with ``swiglu``)::

    y[m, n] = sum_k x[m, k] W[n, k]                                   fp32 accumulation, one rounding
    swiglu:   y[m, n] = silu(g) * u,  g = sum_k x[m, k] W[n, k],  u = sum_k x[m, k] W[N + n, k]

Why a kernel of our own: at 8 rows a GEMM is a stream of W's bytes, and cuBLAS tiles N by 64 to 128
columns there, so a ``[2048, 2048]`` projection runs on a small fraction of the SMs, well short of the
bytes' floor (measured: bench/results/2026-12-02-h200-perf6/README.md). Here one program owns ``BLOCK_N``
(16-64) output columns of one ``BLOCK_M``-row tile and one of ``SPLIT_K`` ranges of K, so even small
projections spread over the whole GPU, and the SwiGLU of a gate|up projection is the GEMM's epilogue
(no ``[M, 2I]`` round trip, one launch fewer). That epilogue reads g and u in fp32; the torch form (a matmul
in x's dtype, then ``swiglu.swiglu_act_torch``) rounds them to x's dtype first, so in bf16 the two differ by
that rounding.

Split-K without a second kernel and without float atomics: each program stores its fp32 partial to
a workspace, then takes a ticket from its output tile's counter (``atomic_add``, acquire-release,
GPU scope, after a CTA barrier so the whole partial is ordered before it). The program drawing the
last ticket sums the SPLIT_K partials in split order (0, 1, ...), whichever programs ran first, so the
bits are the same on every call and in a CUDA-graph replay; it then writes y and resets the counter
to 0 for the next call (``fast/kernels/common/tickets.py``: one zeroed buffer per device). A different
SPLIT_K or BLOCK_K sums in a different order: rounding differences within NUMERIC of the reference,
never between two calls with one config.

Bound: memory (W's bytes once; x is re-read from L2 by each program: ``M K`` elements per column
tile), and at these sizes the latency of a launch, which keeps a small projection well above its bytes'
floor. The kernel beats cuBLAS on some shapes and not on others, so the engine's dispatch
(:func:`skinny_linear`) takes it only for the shapes measured faster, with their measured configs
(:data:`TUNED`, per GPU). No host sync; the grid depends on the shapes and the config only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common.pdl import l2_prefetch_enabled, launch_options, pdl_enabled
from ..common.tickets import ticket_counters
from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton


PREFETCH_ALL = 1 << 30  # SkinnyConfig.prefetch_k: a program's whole K range


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiling of one call (powers of two; BLOCK_M and BLOCK_N at least 16, the tl.dot minimum)."""

    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    # K columns of its W slice each program bulk-prefetches into L2 before its wait (_prefetch_weight): 0 none,
    # >= its K range all of it. It helps the 35B-A3B draft's conv kernel projections, q|k|v and o a little and
    # hurts gate|up and down, so only those three shapes use it (measured: bench/results/2026-12-04-h200-perf13/
    # c3-skinny.log; a side-stream prefetch further ahead, dropped: bench/results/2026-12-04-h200-perf14/).
    prefetch_k: int = 0
    # rows a program owns: 0 takes the row count's power of two, 16 to 64 (one tile for the draft's few rows);
    # 128 holds a 16-request verify block (16 x 8 rows) in one tile, so each W tile is read once
    block_m: int = 0


# (N, K, swiglu) -> (the most rows it was measured faster than cuBLAS at, its fastest config), from the sweeps of
# bench/kernels/bench_skinny_linear.py (back-to-back calls in a graph, at 8 rows, and at 32 where that row count is
# kept; measured: bench/results/2026-12-02-h200-perf7/, and bench/results/2026-12-04-h200-perf13/c3-skinny.log for
# the first three rows). The released drafts' GEMMs that are not here (the 27B draft's q|k|v, o, conv kernel
# projections and gate|up) measured as fast or faster in cuBLAS; an unmeasured shape or GPU goes to cuBLAS too.
H200_TUNED: dict[tuple[int, int, bool], tuple[int, SkinnyConfig]] = {
    # 35B-A3B draft: conv kernel projections, q|k|v, o (the whole slice prefetched)
    (512, 2048, False): (32, SkinnyConfig(block_n=32, block_k=128, split_k=8, prefetch_k=PREFETCH_ALL)),
    (3072, 2048, False): (8, SkinnyConfig(block_n=32, block_k=128, split_k=4, prefetch_k=PREFETCH_ALL)),
    (2048, 2048, False): (32, SkinnyConfig(block_n=32, block_k=128, split_k=4, prefetch_k=PREFETCH_ALL)),
    (5632, 2048, True): (8, SkinnyConfig(block_n=32, block_k=128)),  # gate|up + SwiGLU
    (2048, 5632, False): (32, SkinnyConfig(block_n=32, block_k=128, split_k=4)),  # down
    (2048, 10240, False): (8, SkinnyConfig(block_n=32, block_k=128, split_k=4)),  # fc
    (5120, 17408, False): (8, SkinnyConfig(block_n=32, block_k=128, split_k=2)),  # 27B down
    (5120, 25600, False): (8, SkinnyConfig(block_n=32, block_k=128, split_k=4)),  # 27B fc
}

# GPU (a fragment of its name) -> (N, K, swiglu) -> (fewest rows, most rows, config): the row ranges where the
# kernel was measured faster than cuBLAS on that GPU. Only measured entries: another GPU, shape or row count
# goes to cuBLAS.
TUNED: dict[str, dict[tuple[int, int, bool], tuple[tuple[int, int, SkinnyConfig], ...]]] = {
    "H200": {shape: ((1, most, cfg),) for shape, (most, cfg) in H200_TUNED.items()},
}


@functools.lru_cache(maxsize=None)
def _gpu(device: torch.device) -> str | None:
    """The key of :data:`TUNED` this device's name contains, or None (a CPU, an unmeasured GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gpu for gpu in TUNED if gpu in name), None)


def tuned_config(rows: int, n: int, k: int, swiglu: bool, device: torch.device) -> SkinnyConfig | None:
    """The measured config for this call on this GPU, or None (cuBLAS is as fast, or it was not measured)."""
    gpu = _gpu(device)
    for fewest, most, cfg in TUNED[gpu].get((n, k, swiglu), ()) if gpu else ():
        if fewest <= rows <= most:
            return cfg
    return None


def default_config(rows: int, n: int, k: int, swiglu: bool = False) -> SkinnyConfig:
    """A generic config for a shape the sweep did not cover (direct calls; the engine goes through
    :data:`TUNED`): K in 128-wide steps, 32-column tiles (16 up to N = 1024), and K split in two
    while that keeps at most 256 programs and 256 K columns a split (the rule of the 35B draft's picks;
    the 27B draft's long-K projections wanted more splits)."""
    block_n = 16 if n <= 1024 else 32
    tiles = triton.cdiv(n, block_n) * triton.cdiv(max(rows, 1), 64)
    split = 1
    while split < 8 and tiles * split * 2 <= 256 and k // (split * 2) >= 256:
        split *= 2
    return SkinnyConfig(block_n=block_n, block_k=128, split_k=split)


@triton.jit
def _prefetch_weight(w_ptr, pid_n, k_lo, N: tl.constexpr, K: tl.constexpr, SPAN: tl.constexpr,
                     HALVES: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, ELEM_BYTES: tl.constexpr):
    """Bulk-prefetch into L2 the W rows of this program's BLOCK_N columns (and their up rows, HALVES = 2) over
    the first SPAN columns of its K range: HALVES * BLOCK_N * CHUNKS lanes, one ``cp.async.bulk.prefetch.L2`` of
    SPAN / CHUNKS elements each (CHUNKS sized so every thread issues about one). A prefetch writes nothing and
    no later load depends on it: it only starts W's DRAM reads early, before the wait and before the loop's
    pipeline asks.
    Addresses and sizes are multiples of 16 bytes (the launcher checks W's base and row pitch); a lane whose
    range lies past K or whose column lies past N prefetches 16 bytes of an in-bounds row instead."""
    lanes = tl.arange(0, HALVES * BLOCK_N * CHUNKS)
    row = lanes // CHUNKS
    col = tl.minimum(pid_n * BLOCK_N + row % BLOCK_N, N - 1) + (row // BLOCK_N) * N
    chunk: tl.constexpr = SPAN // CHUNKS
    start = k_lo + (lanes % CHUNKS) * chunk
    count = tl.minimum(tl.maximum(K - start, 0), chunk) * ELEM_BYTES // 16 * 16
    start = tl.where(count > 0, start, 0)
    count = tl.where(count > 0, count, 16)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0", "=r,l,r",
                              [w_ptr + col.to(tl.int64) * K + start, count.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, stride_xm, stride_om,
                          N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
                          M_PAD: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFETCH_SPAN: tl.constexpr,
                          PREFETCH_CHUNKS: tl.constexpr, ELEM_BYTES: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    if PREFETCH_SPAN > 0:  # W only (written once, at load): pdl.EARLY_READERS; the first row tile's programs
        if pid_m == 0:
            _prefetch_weight(w_ptr, pid_n, pid_k * K_PER_SPLIT, N, K, PREFETCH_SPAN, 2 if SWIGLU else 1, BLOCK_N,
                             PREFETCH_CHUNKS, ELEM_BYTES)
    if PDL:  # before any other load, and any store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = rows < M
    in_n = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # W^T's columns: [1, BLOCK_N] row starts of W
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the up half (swiglu only)
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_lo + k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        a = tl.load(x_rows + ks[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = in_k[:, None] & in_n[None, :]
        w = tl.load(w_cols + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N] of W^T, contiguous along K
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            w_up = tl.load(w_cols + N * K + ks[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    out_mask = in_m[:, None] & in_n[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if SPLIT_K == 1:
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # workspace [SPLIT_K, 2, M_PAD, N] fp32: this program's partial (and its up half) at split pid_k
        part = part_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        split_stride = 2 * M_PAD * N
        tl.store(part + pid_k * split_stride, acc, mask=out_mask)
        if SWIGLU:
            tl.store(part + pid_k * split_stride + M_PAD * N, acc_up, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last to arrive: the other partials are visible (acquire)
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order, whoever arrived first
                total += tl.load(part + s * split_stride, mask=out_mask, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    total_up += tl.load(part + s * split_stride + M_PAD * N, mask=out_mask, other=0.0,
                                        cache_modifier=".cg")
            if SWIGLU:
                total = total * tl.sigmoid(total) * total_up
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0)  # zero again for the next call (no other program touches it now)


def _check(x: Tensor, weight: Tensor, swiglu: bool) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {list(x.shape)}, weight {list(weight.shape)}: expected [M, K] and [N, K]")
    if x.dtype != weight.dtype or not x.dtype.is_floating_point:
        raise ValueError(f"x {x.dtype}, weight {weight.dtype}: expected one float dtype")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"weight {list(weight.shape)}: swiglu needs [2I, K] (gate rows, then up rows)")
    rows, k = x.shape
    return rows, weight.shape[0] // 2 if swiglu else weight.shape[0], k


def skinny_linear_torch(x: Tensor, weight: Tensor, swiglu: bool = False) -> Tensor:
    """``x @ weight.T`` (``[M, K] x [N, K] -> [M, N]``), then with ``swiglu`` ``silu(g) * u`` of its
    gate and up halves in fp32, rounded once (``swiglu.swiglu_act_torch``). In x's dtype."""
    _check(x, weight, swiglu)
    if x.device.type == "cpu" and not x.is_contiguous():
        # torch 2.13's CPU bf16 matmul reads past a strided row (17+ rows at K=80 gave NaN from a
        # poisoned row padding, seen in test_skinny_linear); a copy of the few rows is cheap.
        x = x.contiguous()
    y = x @ weight.T
    if not swiglu:
        return y
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def skinny_linear_triton(x: Tensor, weight: Tensor, swiglu: bool = False, config: SkinnyConfig | None = None,
                         out: Tensor | None = None) -> Tensor:
    """``skinny_linear_torch``'s contract by one kernel: x ``[M, K]`` (unit column stride), weight
    contiguous ``[N, K]`` (``[2N, K]`` with swiglu). Returns ``[M, N]`` in x's dtype (or writes ``out``,
    any row stride). ``config`` defaults to :func:`default_config`."""
    rows, n, k = _check(x, weight, swiglu)
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"x strides {x.stride()}: expected a unit column stride")
    if not weight.is_contiguous():
        raise ValueError(f"weight strides {weight.stride()}: expected contiguous [N, K]")
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    elif out.shape != (rows, n) or out.dtype != x.dtype or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out {list(out.shape)} {out.dtype} strides {out.stride()}: expected [{rows}, {n}] "
                         f"{x.dtype} with a unit column stride")
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = default_config(rows, n, k, swiglu) if config is None else config
    block_m = cfg.block_m or max(16, min(64, triton.next_power_of_2(rows)))
    m_tiles, n_tiles = triton.cdiv(rows, block_m), triton.cdiv(n, cfg.block_n)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty split (it would never draw the last ticket's partial)
    if split > 1:
        part = torch.empty((split, 2, m_tiles * block_m, n), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device, m_tiles * n_tiles)
    else:
        part, counters = out, out  # unused
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32; tf32 is unused for bf16/fp16
    elem = weight.element_size()
    # the bulk prefetch wants 16-byte addresses and sizes: W's base, its row pitch and each chunk's start
    halves = 2 if swiglu else 1
    chunks = max(1, 32 * cfg.num_warps // (halves * cfg.block_n))
    span = min(cfg.prefetch_k, k_per_split)
    prefetch = (span > 0 and l2_prefetch_enabled(x.device) and weight.data_ptr() % 16 == 0 and (k * elem) % 16 == 0
                and span % chunks == 0 and (span // chunks * elem) % 16 == 0)
    _skinny_linear_kernel[(n_tiles, split, m_tiles)](
        x, weight, out, part, counters, rows, x.stride(0), out.stride(0), N=n, K=k, K_PER_SPLIT=k_per_split,
        SPLIT_K=split, M_PAD=m_tiles * block_m, SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION=precision, PREFETCH_SPAN=span if prefetch else 0, PREFETCH_CHUNKS=chunks,
        ELEM_BYTES=elem, PDL=pdl_enabled(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(x.device))
    return out


def _tuned(x: Tensor, weight: Tensor, swiglu: bool = False) -> SkinnyConfig | None:
    """The measured config for this call (:data:`TUNED`), or None: the layout the kernel takes and a shape
    and row count measured faster than cuBLAS."""
    if not (weight.is_contiguous() and x.stride(-1) == 1 and x.dim() == 2):
        return None
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return tuned_config(x.shape[0], n, x.shape[1], swiglu, x.device)


def has_tuned_config(x: Tensor, weight: Tensor, swiglu: bool = False) -> bool:
    """Whether :data:`skinny_linear` takes its kernel for this call on a GPU (a measured config exists)."""
    return _tuned(x, weight, swiglu) is not None


def skinny_linear_tuned(x: Tensor, weight: Tensor, swiglu: bool = False) -> Tensor:
    """:func:`skinny_linear_triton` with the measured config of the call's shape (``_tuned`` must have one)."""
    return skinny_linear_triton(x, weight, swiglu, config=_tuned(x, weight, swiglu))


# the kernel with its measured config where TUNED has the shape and row count, the torch form (cuBLAS on CUDA) otherwise
skinny_linear = KernelOp("skinny_linear", skinny_linear_torch,
                         GpuForm(skinny_linear_tuned, fits=lambda *args, **kw: _tuned(*args, **kw) is not None))
