"""The MoE router, softmax + top-k + renormalisation, as two Triton kernels, sync-free and
graph-capturable; twin of ``reference/model/moe.route`` (torch twin: :func:`route_torch`).

N rows, E experts, hidden C, top-k::

    logits = x W_router^T                      [N, E]  fp32 (x upcast, fp32 products and accumulation)
    probs  = softmax(logits)                   [N, E]  exp(l - max l) / sum exp(l - max l)
    top    = the k largest probs, descending;  equal probs: the lowest expert id first
    w      = probs[top] / sum(probs[top])      [N, k]  fp32

Kernel 1 (the GEMV, what bounds the op: reading W_router, E C x 4 bytes, 2 MiB at E = 256,
C = 2048), grid ``(ceil(E / block_e), ceil(N / block_n), S)``: program (i, j, s) takes
``block_e`` experts, ``block_n`` rows and the C range ``[s split_c, (s + 1) split_c)`` (``S =
num_splits``; ``split_c`` a whole number of ``block_c`` steps, the last range cut at C, none
empty). Its product tile ``[block_n, block_e, block_c]`` is accumulated element-wise over its range
and reduced once, in a fixed order, into the partial logits ``P[s] = x[:, range_s] W[:, range_s]^T``
of an fp32 scratch ``[S, N, E]``. Why split C: each C step of a program is a dependent round of
loads, so a program walking all of C is latency-bound however few bytes it reads (at 32 rows, unsplit,
far above its bytes' floor); split in two (the default past 8 rows) it is about twice as fast, while
splits of one or two steps each lose to the extra partials at 128 rows (:func:`default_blocks`; measured:
bench/results/2026-12-01-h200-perf3/README.md). At N = 1
``block_e`` = 2 and S = 1 spread the matrix over E / 2 programs (128 at E = 256), each loading its
16 KiB in one or two steps. W_router is read once per block of rows (ceil(N / block_n) times, from
L2 after the first). Kernel 2, one program per row: the logits are the sum of the S partials
``P[0] + P[1] + ... + P[S - 1]``, added in that order (the shared gate's too), so they do not
depend on which program finished first; at S = 1 it reads the one partial, there is no extra pass.
Then softmax over the row's E logits held in registers (one warp), and k rounds of one max over
keys that order by (prob, lower id), each removing its winner. No atomics, no host sync, grids fixed
by (N, E, C, blocks): a run repeats bit for bit and a CUDA-graph replay equals the eager call (a
different S sums in a different order: the same logits to rounding, not bitwise).
bench/kernels/bench_moe_router.py measures it against the floor (E C x 4 bytes over the copy
bandwidth) and against the torch sequence it replaced, which it beats about three times over at one row
(measured: bench/results/2026-12-01-h200/kernels/router.log).

Past :data:`GEMM_ROWS` rows (prefill chunks, and verify steps of more than 96 rows) kernel 1 gives way to one
cuBLAS GEMM of the same fp32 products (``x.float() @ W_router^T``, TF32 off; the logits written as the single
partial, S = 1) and kernel 2 selects
from it as above. Why: at a prefill chunk's thousands of rows kernel 1's CUDA-core products are slow (0.29 ms a
layer at 2,048 rows: 23 ms of the 35B-A3B's 4,096-token prefill, whose kernels took 239 ms; measured:
bench/results/2026-12-07d-h100-prefill-host/prefill35.log); the GEMM takes 76 us there. Measured on an H100 per
layer of the 35B-A3B router (``bench/kernels/bench_moe_router.py --rows``, graph replays; bench/results/
2026-12-07e-h100-serve-prefill/router_cross.log), kernel 1 + 2 against GEMM + kernel 2: 15.7 / 17.5 us at 64
rows, 25.9 / 18.2 at 128, 42.9 / 24.1 at 256, 285 / 76 at 2,048; GEMM_ROWS = 96 splits the unmeasured gap
between 64 and 128 (a 16-request verify step of 128 rows takes the GEMM). Where TF32 is on for fp32 matmuls (a
global torch setting) the kernel stays, so the products are fp32 at every size.

Two launches rather than one: the select's ``[rows, E]`` tiles inside the GEMV's 8-warp programs would cost
more than the launch saved (a fused form, dropped: bench/results/2026-12-04-h200-perf14/).

The shared expert as one more pair (``shared_gate=True``): w_router is ``[E + 1, C]``, its last row
the shared expert's gate vector; kernel 1 computes its logit with the others, kernel 2 leaves it out
of the softmax and the top-k and appends one column to each row's choices: id ``E`` (the index the
caller stacks the shared expert at, after the E routed ones) with weight ``sigmoid(logit_E)``, so
the routed-expert kernels run the shared expert as a (k+1)-th pair. Returns ``[N, k + 1]``.

Tie rule and torch.topk: ``torch.topk`` promises no order among equal values (on CPU it does not
pick the lowest index: ``topk([.1, .3, .3, .2, .3, .3], 3)`` gives ids 1, 5, 4), so :func:`route_torch`
selects by a stable descending sort instead, whose order is exactly the kernel's: ties by the lowest
id. Without exact ties (real router weights) both choose the same experts in the same order as
torch.topk, and the probabilities and weights are the same numbers as the former topk path.
Triton and torch compute the logits in different summation orders, so their ids agree exactly
unless two probabilities are within rounding (about one ulp of the largest logit, ~1e-6 relative)
of each other at a boundary of the order: EXACT holds for exact ties (planted by duplicate router
rows) and for separated values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

MAX_EXPERTS = 1024  # kernel 2 keeps a row's E probabilities in registers
MAX_TOP_K = 64  # kernel 2 unrolls k rounds
GEMM_ROWS = 96  # past this many rows the logits are one fp32 cuBLAS GEMM (module docstring: the measured crossover)


def gemm_logits_exact() -> bool:
    """Whether torch runs fp32 matmuls in fp32 (no TF32), as the router's products must be."""
    return not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"


@dataclass(frozen=True)
class RouterBlocks:
    """Block sizes of the GEMV kernel (powers of two)."""

    block_n: int  # rows per program
    block_e: int  # experts per program
    block_c: int  # C step
    num_warps: int = 4
    num_splits: int = 1  # programs along C, each its own range of whole block_c steps (module docstring)


def default_blocks(rows: int, num_experts: int, hidden: int) -> RouterBlocks:
    """About 8K products in flight per program at 4 warps, 16K at 8 (64 fp32 accumulator registers
    a thread); the grid in the hundreds of programs for 132 SMs. The rule, the fastest of the sweeps of
    bench/kernels/bench_moe_router.py (E = 256 / 512, per layer): C unsplit up to 8 rows, two experts
    a program at one row and, from 2 to 8 rows, one expert a program over 16K products at 8 warps (measured:
    bench/results/2026-12-01-h200-perf3/call1-router.log). Past 8 rows 16 rows and 8 experts a program in
    C steps of 128 at 8 warps, C split in two (the best tried at E = 256 and 512; unsplit 64-wide steps and 8
    splits were slower; measured: bench/results/2026-12-01-h200-perf3/call3-router.json)."""
    block_n = min(triton.next_power_of_2(max(rows, 1)), 16)
    if rows > 8:
        block_e = min(8, triton.next_power_of_2(num_experts))
        block_c = min(128, triton.next_power_of_2(hidden))
        steps = max(triton.cdiv(hidden, block_c), 1)
        return RouterBlocks(block_n, block_e, block_c, num_warps=8, num_splits=min(2, steps))
    if rows >= 2:
        return RouterBlocks(block_n, 1, min(16384 // block_n, triton.next_power_of_2(hidden)), num_warps=8)
    block_e = min(2, triton.next_power_of_2(num_experts))
    block_c = min(max(8192 // (block_n * block_e), 16), triton.next_power_of_2(hidden))
    return RouterBlocks(block_n, block_e, block_c)


def split_c(blocks: RouterBlocks, hidden: int) -> int:
    """The C range of one split: whole ``block_c`` steps, ``num_splits`` ranges covering C."""
    steps = max(triton.cdiv(hidden, blocks.block_c), 1)
    return blocks.block_c * triton.cdiv(steps, blocks.num_splits)


def check_blocks(blocks: RouterBlocks, hidden: int) -> None:
    """num_splits an int >= 1 with no split's C range empty (a program that would only write zeros)."""
    splits = blocks.num_splits
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"blocks.num_splits {splits!r}: expected an int >= 1")
    used = max(triton.cdiv(hidden, split_c(blocks, hidden)), 1)
    if used != splits:
        raise ValueError(f"blocks.num_splits {splits}: at C = {hidden} in steps of block_c {blocks.block_c}, "
                         f"only {used} splits of whole steps cover C (the others would be empty)")


def route_torch(x: Tensor, w_router: Tensor, top_k: int, *, shared_gate: bool = False) -> tuple[Tensor, Tensor]:
    """The router in torch (the model's former inline code, the selection by a stable sort).

    x: ``[N, C]``; w_router: ``[E, C]`` fp32 (``[E + 1, C]`` with ``shared_gate``, module docstring).
    Returns ``(expert_ids [N, k] int64, weights [N, k] fp32)`` (``[N, k + 1]`` with ``shared_gate``).
    Ties are exact only where the GEMM computes duplicate router rows alike: CPU BLAS gives the tail
    column (the 17th of 17) a different rounding, so a duplicate there is no tie for this twin.
    """
    logits = x.float() @ w_router.T  # [N, E (+ 1)]
    num_routed = w_router.shape[0] - int(shared_gate)
    probs = torch.softmax(logits[:, :num_routed], dim=-1)  # [N, E]
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: lowest id first
    top_probs, expert_ids = sorted_probs[:, :top_k], order[:, :top_k]  # [N, k]
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    if not shared_gate:
        return expert_ids, weights
    shared_ids = torch.full_like(expert_ids[:, :1], num_routed)
    return torch.cat([expert_ids, shared_ids], dim=1), torch.cat([weights, torch.sigmoid(logits[:, num_routed:])], dim=1)


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["rows"])  # one compile serves every row count: none at a new size mid-serve
def _router_logits_kernel(x_ptr, w_ptr, partials_ptr, rows, C: tl.constexpr, E: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                          SPLIT_C: tl.constexpr):
    n_offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e_offs = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    in_n = n_offs < rows
    in_e = e_offs < E
    x_rows = x_ptr + n_offs.to(tl.int64) * C  # [BLOCK_N]
    w_rows = w_ptr + e_offs.to(tl.int64) * C  # [BLOCK_E]
    c_begin = split * SPLIT_C  # this program's C range: [c_begin, c_begin + SPLIT_C), cut at C
    acc = tl.zeros([BLOCK_N, BLOCK_E, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, SPLIT_C, BLOCK_C):
        c_offs = c_begin + c0 + tl.arange(0, BLOCK_C)
        in_c = c_offs < C
        xs = tl.load(x_rows[:, None] + c_offs[None, :], mask=in_n[:, None] & in_c[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_C]
        ws = tl.load(w_rows[:, None] + c_offs[None, :], mask=in_e[:, None] & in_c[None, :],
                     other=0.0)  # [BLOCK_E, BLOCK_C] fp32
        acc += xs[:, None, :] * ws[None, :, :]
    logits = tl.sum(acc, axis=2)  # [BLOCK_N, BLOCK_E], one reduction in a fixed order
    out = partials_ptr + split.to(tl.int64) * rows * E  # partials [S, N, E]
    tl.store(out + n_offs[:, None].to(tl.int64) * E + e_offs[None, :], logits, mask=in_n[:, None] & in_e[None, :])


@triton.jit
def _router_select_kernel(partials_ptr, weights_ptr, ids_ptr, split_stride, E: tl.constexpr, TOP_K: tl.constexpr,
                          E_PAD: tl.constexpr, K_PAD: tl.constexpr, ID_SPAN: tl.constexpr, SHARED: tl.constexpr,
                          NUM_SPLITS: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    e_offs = tl.arange(0, E_PAD)
    in_e = e_offs < E
    row = partials_ptr + n * (E + SHARED)  # split 0's; a shared gate's logit sits after the E routed ones
    logits = tl.load(row + e_offs, mask=in_e, other=float("-inf"))
    part = row
    for _ in tl.static_range(1, NUM_SPLITS):  # the partials in the fixed order 0, 1, ..., S - 1: reproducible
        part += split_stride  # N (E + SHARED): the next split's row, a 64-bit pointer step
        logits += tl.load(part + e_offs, mask=in_e, other=0.0)  # the padding stays -inf
    num = tl.exp(logits - tl.max(logits, axis=0))  # exp(-inf) = 0 in the padding
    probs = num / tl.sum(num, axis=0)
    # One max per round over a key ordering by (prob, then the lower id): a prob >= 0 orders as its
    # fp32 bits (< 2^30, so bits * ID_SPAN < 2^41), the id goes below them inverted; -1 marks the
    # padding and the experts already chosen.
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(in_e, bits * ID_SPAN + (ID_SPAN - 1 - e_offs), -1)  # [E_PAD] int64
    k_offs = tl.arange(0, K_PAD)
    top = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    for j in range(TOP_K):
        best = tl.max(key, axis=0)
        top = tl.where(k_offs == j, (best // ID_SPAN).to(tl.int32).to(tl.float32, bitcast=True), top)
        ids = tl.where(k_offs == j, ID_SPAN - 1 - best % ID_SPAN, ids)
        key = tl.where(key == best, -1, key)  # keys are distinct: the id is part of them
    in_k = k_offs < TOP_K
    total = tl.sum(tl.where(in_k, top, 0.0), axis=0)
    out_k = TOP_K + SHARED
    tl.store(weights_ptr + n * out_k + k_offs, top / total, mask=in_k)
    tl.store(ids_ptr + n * out_k + k_offs, ids, mask=in_k)
    if SHARED:
        gate = tl.load(row + E)
        part = row
        for _ in tl.static_range(1, NUM_SPLITS):  # the same order as the routed logits
            part += split_stride
            gate += tl.load(part + E)
        tl.store(weights_ptr + n * out_k + TOP_K, tl.sigmoid(gate))
        tl.store(ids_ptr + n * out_k + TOP_K, tl.full([], E, tl.int64))


def check_route_inputs(x: Tensor, w_router: Tensor, top_k: int, shared_gate: bool = False) -> None:
    """x [N, C] float, w_router [E (+ 1), C] fp32 with E <= MAX_EXPERTS, 1 <= top_k <= min(E, MAX_TOP_K)."""
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x {list(x.shape)} {x.dtype}: expected a float [N, C]")
    rows_name = "E + 1" if shared_gate else "E"
    if w_router.dim() != 2 or w_router.shape[1] != x.shape[1] or w_router.dtype != torch.float32:
        raise ValueError(f"w_router {list(w_router.shape)} {w_router.dtype}: expected fp32 [{rows_name}, {x.shape[1]}]")
    num_routed = w_router.shape[0] - int(shared_gate)
    if not 1 <= num_routed <= MAX_EXPERTS:
        raise ValueError(f"w_router {list(w_router.shape)}: expected [{rows_name}, C] with 1 <= E <= {MAX_EXPERTS}")
    if not isinstance(top_k, int) or not 1 <= top_k <= min(num_routed, MAX_TOP_K):
        raise ValueError(f"top_k {top_k!r}: expected an int in [1, {min(num_routed, MAX_TOP_K)}]")
    if x.device != w_router.device:
        raise ValueError(f"w_router on {w_router.device}: expected x's device {x.device}")


def route_triton(x: Tensor, w_router: Tensor, top_k: int, *, shared_gate: bool = False,
                 blocks: RouterBlocks | None = None, logits: Tensor | None = None,
                 gemm: bool | None = None) -> tuple[Tensor, Tensor]:
    """:func:`route_torch`'s contract by the two kernels: x ``[N, C]`` (any float dtype, upcast),
    w_router ``[E, C]`` fp32 (``[E + 1, C]`` with ``shared_gate``); returns ``(expert_ids [N, k]
    int64, weights [N, k] fp32)`` (``k + 1`` columns with ``shared_gate``).

    ``blocks`` defaults to :func:`default_blocks`; ``logits`` (fp32 ``[S, N, E (+ 1)]``, S =
    ``blocks.num_splits``; ``[N, E (+ 1)]`` also at S = 1) is the partial-logits scratch to write
    instead of a fresh one (the tests poison it). ``gemm``: the logits by one fp32 GEMM instead of
    kernel 1 (S = 1, ``blocks`` unused); default past :data:`GEMM_ROWS` rows where TF32 is off.
    """
    check_route_inputs(x, w_router, top_k, shared_gate)
    rows, hidden = x.shape
    num_logits = w_router.shape[0]
    num_experts = num_logits - int(shared_gate)
    if gemm is None:
        gemm = rows > GEMM_ROWS and blocks is None and gemm_logits_exact()
    if gemm:
        blocks = RouterBlocks(1, 1, triton.next_power_of_2(hidden))  # S = 1: the GEMM writes the one partial
    blocks = default_blocks(rows, num_logits, hidden) if blocks is None else blocks
    check_blocks(blocks, hidden)
    splits = blocks.num_splits
    shape = (splits, rows, num_logits)
    if logits is None:
        logits = torch.empty(shape, dtype=torch.float32, device=x.device)
    elif ((logits.shape != shape and not (splits == 1 and logits.shape == shape[1:]))
          or logits.dtype != torch.float32 or not logits.is_contiguous() or logits.device != x.device):
        one = f" (or [{rows}, {num_logits}])" if splits == 1 else ""
        raise ValueError(f"logits {list(logits.shape)} {logits.dtype} on {logits.device}: expected contiguous "
                         f"fp32 [{splits}, {rows}, {num_logits}]{one} on {x.device} (blocks.num_splits {splits})")
    out_k = top_k + int(shared_gate)
    expert_ids = torch.empty((rows, out_k), dtype=torch.int64, device=x.device)
    weights = torch.empty((rows, out_k), dtype=torch.float32, device=x.device)
    if rows == 0:
        return expert_ids, weights
    x, w_router = x.contiguous(), w_router.contiguous()  # the model's are already
    if gemm:
        torch.mm(x.float(), w_router.T, out=logits.view(rows, num_logits))
    else:
        grid = (triton.cdiv(num_logits, blocks.block_e), triton.cdiv(rows, blocks.block_n), splits)
        _router_logits_kernel[grid](
            x, w_router, logits, rows, C=hidden, E=num_logits, BLOCK_N=blocks.block_n, BLOCK_E=blocks.block_e,
            BLOCK_C=blocks.block_c, SPLIT_C=split_c(blocks, hidden), num_warps=blocks.num_warps)
    e_pad = triton.next_power_of_2(num_experts)
    _router_select_kernel[(rows,)](
        logits, weights, expert_ids, rows * num_logits, E=num_experts, TOP_K=top_k, E_PAD=e_pad,
        K_PAD=triton.next_power_of_2(top_k), ID_SPAN=e_pad, SHARED=int(shared_gate), NUM_SPLITS=splits,
        num_warps=1 if e_pad <= 512 else 2)  # within one warp the k rounds of reductions are shuffles only
    return expert_ids, weights


# ``(expert_ids [N, k] int64, weights [N, k] fp32)``; the kernels (no host sync) for CUDA tensors of every row
# count: a prefill chunk routes by the same tie rule as the decode and verify steps (its logits, as a wide verify
# step's, by an fp32 GEMM past GEMM_ROWS rows: the same products, summed in another order), eager or captured
route = KernelOp("route", route_torch, GpuForm(route_triton))
