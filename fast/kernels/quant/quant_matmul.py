"""``y = x @ W^T`` for a few rows of x (decode and verify: N <= 64) with W a GGUF-quantized matrix read as its
bytes (:class:`~.layout.QuantWeight`), fused: no dequantized copy of W is ever written. Twin: the torch form
``quant_matmul_torch`` (dequantize to x's dtype, then the matmul).

x ``[N, K]`` (fp32, fp16 or bf16), W ``[R, K]`` quantized (R outputs, K inputs, whole blocks) -> y ``[N, R]`` in
x's dtype::

    y[n, r] = sum_k x[n, k] w[r, k],   w = dequantize(W) rounded to x's dtype,   fp32 accumulation

Why fused: at a few rows the product is a stream of W's bytes, and a GGUF weight is 3-8.5 bits a value; a
dequantized bf16 copy would be written and read again at 16 (4-5x the bytes of the quantized stream at Q4_K and
IQ3_XXS). Here each program decodes its W tile in registers, 256 values of a row at a time
(``dequant_triton._decode_tile``: the same fp32 values as the twin's dequantization), rounds it to x's
dtype (the twin's rounding too) and multiplies it with the matching ``[BLOCK_M, 256]`` columns of x: ``tl.dot``
with fp32 accumulation, or for one row (decode) a multiply and row sum, which needs no 16-row padding. So the
fused product differs from the twin by summation order only (NUMERIC, docs/tolerances.md).

Grid ``(cdiv(R, BLOCK_R), SPLIT_K, cdiv(N, BLOCK_M))``: one program owns BLOCK_R rows of W (outputs), one of
SPLIT_K ranges of its 256-value tiles, one BLOCK_M tile of x's rows. Split-K is skinny_linear's (no float atomics, no
second kernel): each program stores its fp32 partial to a workspace, takes a ticket from its output tile's
counter (``fast/kernels/common/tickets.py``); the last to arrive sums the partials in split order, writes y and
resets the counter, so the bits are the same on every call and in a CUDA-graph replay.

Routed experts (``quant_matmul_experts``): W stacked ``[E, R, K]``, x ``[P, K]`` one row a (token, expert) pair and
``expert_ids [P]``; the same kernel, one x row a program column, each program offsetting W by its pair's expert
(read on the device), so a decode MoE layer is two launches (gate|up, then down) reading only the chosen
experts' bytes. Twin: one dequantize + matmul per expert present (a host sync).

Bound: W's bytes and the decode's integer work (a handful of ops a value, more for the IQ types' table
lookups). The config (:func:`default_config`) is a rule of thumb, not a measurement: bench/kernels/
bench_quant_linear.py measures it against the bytes' floor at the released models' shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from ..common.pdl import launch_options, pdl_enabled
from ..common.tickets import ticket_counters
from ..common.triton_compat import tl, triton
from .dequant_torch import dequantize_torch
from .dequant_triton import TILE, _decode_tile
from .layout import QUANT_TYPES, QuantWeight, block_shape
from .tables import iq_tables

MAX_ROWS = 64  # the kernel's domain: x rows at most this (one or more BLOCK_M tiles of at most 64)
X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class QuantMatmulConfig:
    """Tiling of one call: BLOCK_R output rows a program (a power of two, >= 16 for ``tl.dot``), K split in
    ``split_k`` ranges of whole blocks."""

    block_r: int = 32
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


def default_config(rows: int, r: int, k: int, qtype) -> QuantMatmulConfig:
    """A rule of thumb (unmeasured): 32-row tiles (16 up to R = 1024), and K split in two while that keeps at
    most 512 programs and at least 4 tiles of 256 values a split, so a small R still spreads over the GPU."""
    block_r = 16 if r <= 1024 else 32
    tiles = triton.cdiv(r, block_r) * triton.cdiv(max(rows, 1), 64)
    k_tiles = triton.cdiv(k, TILE)
    split = 1
    while split < 16 and tiles * split * 2 <= 512 and k_tiles // (split * 2) >= 4:
        split *= 2
    return QuantMatmulConfig(block_r=block_r, split_k=split)


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, part_ptr, count_ptr, grid_ptr, kv_ptr, M, R, stride_xm,
                         stride_om, EXPERTS: tl.constexpr, QTYPE: tl.constexpr, K: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                         NUM_KB: tl.constexpr, NUM_T: tl.constexpr, T_PER_SPLIT: tl.constexpr,
                         SPLIT_K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows_w = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_x = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_r = rows_w < R
    in_m = rows_x < M
    if EXPERTS:  # stacked [E, R, ROW_BYTES]: x row pid_m (BLOCK_M = 1) against its expert's matrix
        w_ptr += tl.load(ids_ptr + pid_m).to(tl.int64) * R * ROW_BYTES
    w_rows = w_ptr + rows_w.to(tl.int64)[:, None, None] * ROW_BYTES  # [BLOCK_R, 1, 1]
    x_rows = x_ptr + rows_x.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for i in range(T_PER_SPLIT):
        t = pid_k * T_PER_SPLIT + i
        live = t < NUM_T  # the last split may be short: its missing tiles read as zeros
        w = _decode_tile(w_rows, in_r[:, None, None] & live, t, QTYPE, NUM_KB, BLOCK_BYTES, grid_ptr, kv_ptr)
        w = tl.reshape(w, (BLOCK_R, 256)).to(x_ptr.dtype.element_ty)  # the twin's rounding of W to x's dtype
        ks = 256 * t + tl.arange(0, 256)
        a = tl.load(x_rows + ks[None, :], mask=in_m[:, None] & (ks < K)[None, :] & live, other=0.0)
        if BLOCK_M == 1:  # decode: products and a row sum, no 16-row padding of a dot
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out_mask = in_m[:, None] & in_r[None, :]
    out_ptrs = out_ptr + rows_x.to(tl.int64)[:, None] * stride_om + rows_w[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # workspace [SPLIT_K, M_PAD, R] fp32: this program's partial at split pid_k
        part = part_ptr + rows_x.to(tl.int64)[:, None] * R + rows_w[None, :]
        tl.store(part + pid_k * M_PAD * R, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_r
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last to arrive: the other partials are visible (acquire)
            total = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order, whoever arrived first
                total += tl.load(part + s * M_PAD * R, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0)  # zero again for the next call (no other program touches it now)


def _check(x: Tensor, qw: QuantWeight) -> None:
    if x.dim() != 2 or len(qw.shape) != 2 or x.shape[1] != qw.cols:
        raise ValueError(f"x {list(x.shape)}, weight {list(qw.shape)}: expected [N, K] and [R, K]")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x {x.dtype}: expected one of {X_DTYPES}")


def quant_matmul_torch(x: Tensor, qw: QuantWeight) -> Tensor:
    """``x @ dequantize(qw).T`` (``[N, K] x [R, K] -> [N, R]``) with W rounded to x's dtype, in x's dtype."""
    _check(x, qw)
    if x.device.type == "cpu" and not x.is_contiguous():
        x = x.contiguous()  # skinny_linear_torch's reason: torch 2.13's CPU bf16 matmul and strided rows
    return x @ dequantize_torch(qw, x.dtype).T


def quant_matmul_triton(x: Tensor, qw: QuantWeight, config: QuantMatmulConfig | None = None,
                        out: Tensor | None = None) -> Tensor:
    """``quant_matmul_torch``'s contract by one kernel: x ``[N, K]`` (unit column stride, N <= MAX_ROWS), ``qw``
    a block type ``[R, K]``. Returns ``[N, R]`` in x's dtype (or writes ``out``, any row stride). ``config``
    defaults to :func:`default_config`."""
    _check(x, qw)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows > MAX_ROWS={MAX_ROWS}: dequantize and use a dense matmul")
    return _launch(x, qw, None, config, out)


def _launch(x: Tensor, qw: QuantWeight, expert_ids: Tensor | None, config: QuantMatmulConfig | None,
            out: Tensor | None) -> Tensor:
    if qw.qtype not in QUANT_TYPES:
        raise ValueError(f"quant_matmul_triton: {qw.qtype.name} is not a block type")
    rows, k, r = x.shape[0], x.shape[1], qw.rows
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"x strides {x.stride()}: expected a unit column stride")
    if out is None:
        out = torch.empty((rows, r), dtype=x.dtype, device=x.device)
    elif out.shape != (rows, r) or out.dtype != x.dtype or (r > 1 and out.stride(1) != 1):
        raise ValueError(f"out {list(out.shape)} {out.dtype} strides {out.stride()}: expected [{rows}, {r}] "
                         f"{x.dtype} with a unit column stride")
    if rows == 0 or r == 0:
        return out
    experts = expert_ids is not None
    cfg = default_config(1 if experts else rows, r, k, qw.qtype) if config is None else config
    elems, nbytes = block_shape(qw.qtype)
    num_t = triton.cdiv(k, TILE)
    block_m = 1 if rows == 1 or experts else max(16, min(64, triton.next_power_of_2(rows)))
    m_tiles, r_tiles = triton.cdiv(rows, block_m), triton.cdiv(r, cfg.block_r)
    t_per_split = triton.cdiv(num_t, max(1, min(cfg.split_k, num_t)))
    split = triton.cdiv(num_t, t_per_split)  # no empty split (it would never draw the last ticket's partial)
    if split > 1:
        part = torch.empty((split, m_tiles * block_m, r), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device, m_tiles * r_tiles)
    else:
        part, counters = out, out  # unused
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32; tf32 is unused for bf16/fp16
    tables = iq_tables(x.device)
    _quant_matmul_kernel[(r_tiles, split, m_tiles)](
        x, qw.data, expert_ids if experts else out, out, part, counters, tables.iq3xxs_grid_packed,
        tables.iq4_kvalues, rows, r, x.stride(0), out.stride(0), EXPERTS=experts, QTYPE=int(qw.qtype), K=k,
        ROW_BYTES=qw.data.shape[-1], BLOCK_BYTES=nbytes, NUM_KB=k // elems, NUM_T=num_t, T_PER_SPLIT=t_per_split,
        SPLIT_K=split, M_PAD=m_tiles * block_m, BLOCK_M=block_m, BLOCK_R=cfg.block_r, DOT_PRECISION=precision,
        PDL=pdl_enabled(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device))
    return out


def _fits(x: Tensor, qw: QuantWeight, *args, **kwargs) -> bool:
    """The calls the kernel takes: a block type, 2-D x of at most MAX_ROWS rows with a unit column stride."""
    return (qw.qtype in QUANT_TYPES and len(qw.shape) == 2 and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and x.dtype in X_DTYPES and (x.stride(1) == 1 or x.shape[1] <= 1))


# x first: the dispatch goes by the device of the call's first tensor argument
quant_matmul = KernelOp("quant_matmul", quant_matmul_torch, GpuForm(quant_matmul_triton, fits=_fits))


# -- routed experts: each row of x against its own expert's matrix --------------------------------------

def _check_experts(x: Tensor, qw: QuantWeight, expert_ids: Tensor) -> None:
    if qw.num_experts is None or x.dim() != 2 or x.shape[1] != qw.cols:
        raise ValueError(f"x {list(x.shape)}, weight {list(qw.shape)}: expected [P, K] and stacked [E, R, K]")
    if tuple(expert_ids.shape) != (x.shape[0],) or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids {list(expert_ids.shape)} {expert_ids.dtype}: expected [{x.shape[0]}] int32 or "
                         "int64")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x {x.dtype}: expected one of {X_DTYPES}")


def quant_matmul_experts_torch(x: Tensor, qw: QuantWeight, expert_ids: Tensor) -> Tensor:
    """``y[p] = x[p] @ dequantize(qw[expert_ids[p]]).T``: x ``[P, K]`` (one row a (token, expert) pair), ``qw``
    stacked ``[E, R, K]``, ids in ``[0, E)`` -> ``[P, R]`` in x's dtype. One :func:`quant_matmul_torch` per expert
    present (reading the ids on the host: not capturable)."""
    _check_experts(x, qw, expert_ids)
    out = torch.empty((x.shape[0], qw.rows), dtype=x.dtype, device=x.device)
    for e in expert_ids.unique().tolist():
        chosen = expert_ids == e
        out[chosen] = quant_matmul_torch(x[chosen], qw[e])
    return out


def quant_matmul_experts_triton(x: Tensor, qw: QuantWeight, expert_ids: Tensor,
                                config: QuantMatmulConfig | None = None, out: Tensor | None = None) -> Tensor:
    """``quant_matmul_experts_torch``'s contract by the fused kernel, one program column a pair (BLOCK_M = 1: the
    decode path, a row sum, no dot), its expert's bytes found from the id on the device (no host sync; an id
    outside ``[0, E)`` reads outside the weight). The decode MoE is two calls, gate|up then down, each a
    stream of only the chosen experts' bytes; the SwiGLU and the weighted sum stay outside."""
    _check_experts(x, qw, expert_ids)
    return _launch(x, qw, expert_ids, config, out)


quant_matmul_experts = KernelOp(
    "quant_matmul_experts", quant_matmul_experts_torch,
    GpuForm(quant_matmul_experts_triton,
            fits=lambda x, qw, expert_ids, *a, **k: qw.qtype in QUANT_TYPES and x.dtype in X_DTYPES
            and (x.stride(1) == 1 or x.shape[1] <= 1)),
    torch_capturable=False)
