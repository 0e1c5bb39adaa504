"""The routed experts of the MoE sublayer as two Triton kernels (three in the split form), sync-free and
graph-capturable, twin of ``reference/model/moe.routed_experts``, beside its torch twin :func:`moe_experts_torch`
(one matmul pair per active expert after a host read of the per-expert counts: not capturable).

N rows, k choices each, E experts of width I, pairs ``p = n k + j`` (P = N k)::

    h_p   = silu(W_gate[e_p] x_n) * (W_up[e_p] x_n)                  [I]     e_p = expert_ids[n, j]
    y_n   = sum_j weights[n, j] W_down[e_p] h_p                       [C], fp32

Kernel 1, one program per (pair p, I tile of ``block_i``): the program whose pair is the first
one (lowest p) choosing its expert e leads; the others exit after scanning the P ids. The
leader gathers the pairs choosing e in chunks of ``block_m`` (ascending p, found by a prefix
count over the ids), computes their ``h`` tile from the tile's gate and up rows (fp32
accumulation over C), and multiplies it straight into the tile's columns of W_down[e], writing
the partial products ``partials [P, T, C]`` fp32 (T = I / block_i tiles; split-K over I). Each
tile of each active expert's weights is read once per chunk of ``block_m`` pairs, i.e. once a
step while no expert has more than ``block_m`` rows. Kernel 2, one program per (row, C tile),
sums ``y_n = sum_j weights[n, j] sum_t partials[p, t]`` in that fixed order: no atomics, so
the result is bitwise reproducible and a CUDA-graph replay equals the eager call.

Split form (``MoEBlocks.split``; three kernels): kernel 1, one program per (pair, I tile), the leader
writes ``h [P, I]`` (the down weights' dtype, as the fused form rounds it); kernel 2, one program
per (pair, C tile of ``block_c``), the leader reduces all of I in ``block_d`` steps for its C tile,
``partials [P, 1, C] = W_down[e_p] h_p`` fp32; the sum kernel adds the k choices. Why: the fused
form's programs each stream 768 KiB at 8 rows (I tiles of 64), one resident per SM with a 4-stage
pipeline, so the ~470 programs of a verify layer (58 experts) end in a partial last wave; the split
form's programs stream 128-256 KiB each and its partials are T times smaller. It rounds differently
(one fp32 accumulation over I instead of T partial sums), within NUMERIC of the reference. It is the
faster form from 8 to 16 rows (:func:`default_blocks`; bench/kernels/bench_moe.py sweeps both; measured:
bench/results/2026-12-01-h200-perf5/call1-moe_sweep.log).

Overlapped split form (``MoEBlocks.overlap``, with a caller's ``ready`` buffer): in the split form every down
program waits for the whole gate/up grid, so each layer pays the gate/up kernel's last, partial wave with the
weight stream running down, then the down kernel's ramp. Here a down program waits only for its own expert:
each gate/up leader adds 1 to ``ready[e]`` (release, after a CTA barrier over its h stores) and a down leader
spins until ``ready[e]`` counts all ``ceil(I / block_i)`` tiles (acquire), then reads h through L2 only. Both
grids put the pair axis second, so an expert's tiles are scheduled together and finish early, one expert after
another. With PDL the down kernel is launched once every gate/up program has started (each triggers right after
its own wait), so no program it spins on waits for a free slot; without PDL the counters are complete before it
starts. The sum kernel (after its wait: every down program has read its counter) zeroes the counters it used,
so the call leaves ``ready`` all zero. Same arithmetic, same bits as the split form, and faster than it at 8
and 16 rows (``bench_moe.py --blocks-ab``; measured: bench/results/2026-12-04-h200-perf14/).

On Hopper the kernels launch with PDL (fast/kernels/common/pdl.py; ``LaunchSettings.pdl``, from ``EngineConfig.pdl``,
turns it off, bit for bit the same): each launch then hides under the previous kernel's tail (``bench_moe.py
--pdl-ab``; measured: bench/results/2026-12-03-h200-perf9/README.md).

No host sync and no data-dependent shape: the grids and buffers depend on (N, k, E, C, I) only.
What bounds it: the weight bytes of the distinct experts chosen (memory); the partials add
``2 P T C x 4`` bytes and the id scans ``P x T x P`` loads from L2, which is why the op
(:func:`moe_experts_gpu`) sends more than :data:`MAX_TRITON_PAIRS` pairs (a long prefill) to the
grouped GEMM of ``moe_grouped.py`` (the pairs sorted by expert into blocks, tensor-core tiles).
bench/kernels/bench_moe.py measures the fraction of the floor reached.

A precondition that cannot be checked without a sync: every id in ``[0, E)``. (A row may repeat
an expert here, each pair counts once; the reference assumes a row's k experts distinct.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from ..common.pdl import launch_options, pdl_enabled
from ..common.triton_compat import tl, triton
from ..dense.swiglu import swiglu

# (row, choice) pairs; above, the grouped GEMM. At the 35B-A3B shape on an H100 the per-pair kernels took 0.93 ms a
# layer at 1,032 pairs (a 129-row cached chat turn) and 1.26 ms at 2,048, where the grouped GEMM took 0.64 ms
# (bench/results/2026-12-07d-h100-prefill-host/prefill35.log, 2026-12-07c-h100-open-figures/bench_moe.log); their
# id scans grow as P^2. 1,024 keeps every decode and verify step of up to 128 rows (16 requests x 8) on the per-pair
# kernels; where below it the two cross is not measured yet (bench_moe.py --prefill 16,..,256)
MAX_TRITON_PAIRS = 1024


@dataclass(frozen=True)
class MoEBlocks:
    """Block sizes of the two kernels (powers of two; the tl.dot ones at least 16)."""

    block_m: int = 16  # pairs per chunk (rows of the tl.dot)
    block_i: int = 32  # the I tile one program owns (split-K of the down projection)
    block_k: int = 128  # C step of the gate/up accumulation
    block_c: int = 128  # C step of the down projection
    pair_tile: int = 32  # ids scanned per step (wider tiles cost registers: 168 vs 128 at N = 16, sm_90)
    sum_block_c: int = 64  # C tile of the sum kernel
    num_warps: int = 4
    num_stages: int = 3
    # split: the down projection as its own kernel (module docstring, "Split form"): block_c is then the
    # C tile one down program owns (it reduces all of I in block_d steps) and the partials have one tile
    split: bool = False
    block_d: int = 128  # I step of the split form's down kernel
    # overlap (split form only): each down program starts once its own expert's h is written, counted by a per-expert
    # ready counter, instead of after the whole gate/up grid (module docstring, "Overlapped split form")
    overlap: bool = False


def default_blocks(rows: int) -> MoEBlocks:
    """The blocks for a call of ``rows`` rows: at each row count the fastest of the sweeps of
    bench/kernels/bench_moe.py (per layer, CUDA-graph replays), the fused form wherever no other was measured
    faster:

    - 1 row (plain decode): fused, the down projection in 256-column steps, a 4-stage pipeline (measured:
      bench/results/2026-12-01-h200/kernels/bench_moe.log);
    - 2 to 7 rows: fused, I tiles of 64 (half the programs and half the partials of 32-wide tiles), a 4-stage
      pipeline from 5 rows (measured: bench/results/2026-12-01-h200-perf3/call1-bench_moe.log);
    - 8 to 16 rows (a verify of k = 7 is 8 rows a request): the split form, overlapped wherever the caller passes
      ``ready`` (module docstring), down programs of 128 columns, I tiles of 32 at 8 rows and of 64 above
      (measured: bench/results/2026-12-01-h200-perf5/call1-moe_sweep.log for the split form,
      bench/results/2026-12-04-h200-perf14/ for the overlap and its tiles);
    - 17 to 128 rows: fused, I tiles of 64 (not swept); past 128 rows, the same with 64-pair chunks.

    Alternatives measured and dropped (a fused sum, one persistent launch, other sum tiles, the split form at
    1 row): bench/results/2026-12-02-h200-perf7/, -perf8/ and 2026-12-03-h200-perf12/."""
    if rows == 1:
        return MoEBlocks(block_c=256, num_stages=4)
    if rows <= 4:
        return MoEBlocks(block_i=64)
    if rows < 8:
        return MoEBlocks(block_i=64, num_stages=4)
    if rows == 8:
        return MoEBlocks(block_i=32, block_c=128, split=True, block_d=128, overlap=True)
    if rows <= 16:
        return MoEBlocks(block_i=64, block_c=128, split=True, block_d=128, overlap=True)
    if rows <= 128:
        return MoEBlocks(block_i=64)
    return MoEBlocks(block_m=64, block_i=64)


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit
def _pair_and_tile(PAIR_AXIS_SECOND: tl.constexpr):
    """This program's (pair, tile): grid axes (pair, tile), or (tile, pair) so that the tiles of one pair's
    expert are scheduled together (the overlapped split form)."""
    if PAIR_AXIS_SECOND:
        pair = tl.program_id(1)
        tile = tl.program_id(0)
    else:
        pair = tl.program_id(0)
        tile = tl.program_id(1)
    return pair, tile


@triton.jit
def _scan_expert(ids_ptr, p, num_pairs, P_PAD: tl.constexpr, PAIR_TILE: tl.constexpr):
    """Pair p's expert e, how many pairs choose e, and whether p is the first of them."""
    e = tl.load(ids_ptr + p)
    count = 0
    before = 0
    for t in range(P_PAD // PAIR_TILE):
        q = t * PAIR_TILE + tl.arange(0, PAIR_TILE)
        match = (tl.load(ids_ptr + q, mask=q < num_pairs, other=-1) == e).to(tl.int32)
        count += tl.sum(match, axis=0)
        before += tl.sum(tl.where(q < p, match, 0), axis=0)
    return e, count, before == 0


@triton.jit
def _chunk_pairs(ids_ptr, e, num_pairs, count, first, P_PAD: tl.constexpr, PAIR_TILE: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """``(pairs, valid)`` [BLOCK_M]: the pairs choosing e with ranks ``first .. first + BLOCK_M - 1`` in
    ascending pair order, and which ranks exist (< count; the others' pair is 0, to be masked)."""
    wanted = first + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    pairs = tl.zeros([BLOCK_M], dtype=tl.int32)
    seen = 0  # pairs choosing e in the tiles already scanned
    for t in range(P_PAD // PAIR_TILE):
        q = t * PAIR_TILE + tl.arange(0, PAIR_TILE)
        match = (tl.load(ids_ptr + q, mask=q < num_pairs, other=-1) == e).to(tl.int32)
        rank = seen + tl.cumsum(match, axis=0) - 1  # [PAIR_TILE], the rank of each matching pair
        hit = (match[None, :] == 1) & (rank[None, :] == wanted[:, None])  # [BLOCK_M, PAIR_TILE], one per row
        pairs += tl.sum(tl.where(hit, q[None, :], 0), axis=1)
        seen += tl.sum(match, axis=0)
    return pairs, wanted < count


@triton.jit
def _gate_up_rows(gate_up_ptr, e, tile, C: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr):
    """The I tile ``tile`` of expert e: its offsets, their mask, and the row starts of its W_gate and
    W_up rows (gate_up[e] [2I, C]: W_gate is rows 0 .. I-1, W_up rows I .. 2I-1), each [BLOCK_I]."""
    i_offs = tile * BLOCK_I + tl.arange(0, BLOCK_I)
    gate_rows = gate_up_ptr + e * (2 * I * C) + i_offs * C
    return i_offs, i_offs < I, gate_rows, gate_rows + I * C


@triton.jit
def _gate_up_tile(x_ptr, rows, valid, gate_rows, up_rows, in_i, C: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(W_gate x, W_up x)`` of one chunk of rows on one I tile, fp32 ``[BLOCK_M, BLOCK_I]`` each, accumulated
    over C in BLOCK_K steps (``gate_rows``, ``up_rows``: the tile's row starts in W_gate[e], W_up[e])."""
    acc_gate = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        in_k = k_offs < C
        a = tl.load(x_ptr + rows[:, None] * C + k_offs[None, :],
                    mask=valid[:, None] & in_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = in_k[:, None] & in_i[None, :]
        w_gate = tl.load(gate_rows[None, :] + k_offs[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_I]
        w_up = tl.load(up_rows[None, :] + k_offs[:, None], mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    return acc_gate, acc_up


@triton.jit
def _moe_expert_tile_kernel(x_ptr, ids_ptr, gate_up_ptr, down_ptr, partials_ptr, num_pairs,
                            C: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, NUM_TILES: tl.constexpr,
                            P_PAD: tl.constexpr, PAIR_TILE: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_C: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule (the ids are the previous kernel's)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    tile = tl.program_id(1)
    e, count, leader = _scan_expert(ids_ptr, p, num_pairs, P_PAD, PAIR_TILE)
    if leader:
        i_offs, in_i, gate_rows, up_rows = _gate_up_rows(gate_up_ptr, e, tile, C, I, BLOCK_I)
        down_cols = down_ptr + e * (C * I) + i_offs  # [BLOCK_I] column starts of W_down[e] [C, I]
        for chunk in range(MAX_CHUNKS):
            if chunk * BLOCK_M < count:
                pairs, valid = _chunk_pairs(ids_ptr, e, num_pairs, count, chunk * BLOCK_M, P_PAD, PAIR_TILE, BLOCK_M)
                acc_gate, acc_up = _gate_up_tile(x_ptr, (pairs // TOP_K).to(tl.int64), valid, gate_rows, up_rows,
                                                 in_i, C, BLOCK_M, BLOCK_I, BLOCK_K, DOT_PRECISION)
                h = (acc_gate * tl.sigmoid(acc_gate) * acc_up).to(down_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_I]
                out_rows = partials_ptr + pairs.to(tl.int64) * (NUM_TILES * C) + tile * C  # [BLOCK_M]
                for c0 in range(0, C, BLOCK_C):
                    c_offs = c0 + tl.arange(0, BLOCK_C)
                    in_c = c_offs < C
                    w_down = tl.load(down_cols[:, None] + c_offs[None, :] * I,
                                     mask=in_i[:, None] & in_c[None, :], other=0.0)  # [BLOCK_I, BLOCK_C]
                    y = tl.dot(h, w_down, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_C] fp32
                    tl.store(out_rows[:, None] + c_offs[None, :], y, mask=valid[:, None] & in_c[None, :])


@triton.jit
def _moe_gate_up_kernel(x_ptr, ids_ptr, gate_up_ptr, h_ptr, ready_ptr, num_pairs, C: tl.constexpr, I: tl.constexpr,
                        TOP_K: tl.constexpr, P_PAD: tl.constexpr, PAIR_TILE: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, OVERLAP: tl.constexpr, PDL: tl.constexpr):
    """Split form, kernel 1: ``h [P, I]`` (the down weights' dtype) for the I tile of each active expert.
    OVERLAP: the grid is (tile, pair), so an expert's tiles are scheduled together, and each leader counts its
    tile into ``ready[e]`` once its h stores are done (release), for the down programs waiting on it."""
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule (the ids are the previous kernel's)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p, tile = _pair_and_tile(OVERLAP)
    e, count, leader = _scan_expert(ids_ptr, p, num_pairs, P_PAD, PAIR_TILE)
    if leader:
        i_offs, in_i, gate_rows, up_rows = _gate_up_rows(gate_up_ptr, e, tile, C, I, BLOCK_I)
        for chunk in range(MAX_CHUNKS):
            if chunk * BLOCK_M < count:
                pairs, valid = _chunk_pairs(ids_ptr, e, num_pairs, count, chunk * BLOCK_M, P_PAD, PAIR_TILE, BLOCK_M)
                acc_gate, acc_up = _gate_up_tile(x_ptr, (pairs // TOP_K).to(tl.int64), valid, gate_rows, up_rows,
                                                 in_i, C, BLOCK_M, BLOCK_I, BLOCK_K, DOT_PRECISION)
                h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [BLOCK_M, BLOCK_I]
                tl.store(h_ptr + pairs.to(tl.int64)[:, None] * I + i_offs[None, :], h.to(h_ptr.dtype.element_ty),
                         mask=valid[:, None] & in_i[None, :])
        if OVERLAP:
            tl.debug_barrier()  # every thread's h stores before the one release below (the CTA's writes, cumulative)
            tl.atomic_add(ready_ptr + e, 1, sem="release", scope="gpu")


@triton.jit
def _moe_down_kernel(ids_ptr, h_ptr, down_ptr, partials_ptr, ready_ptr, num_pairs, C: tl.constexpr, I: tl.constexpr,
                     NUM_I_TILES: tl.constexpr, P_PAD: tl.constexpr, PAIR_TILE: tl.constexpr,
                     MAX_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, OVERLAP: tl.constexpr, PDL: tl.constexpr):
    """Split form, kernel 2: ``partials[p] [C]`` fp32 = W_down[e_p] h_p for the C tile of each active expert,
    reducing all of I (one partial per pair: the sum kernel then adds the k choices only).

    With PDL it scans the ids before its wait, as pdl.py's early-read rule allows (the router wrote them two
    kernels back: the gate/up kernel, launched with PDL, triggers only after its own wait); h, the gate/up
    kernel's output, only after. A non-leader exits without waiting (it wrote nothing); every launch has
    leaders (P > 0), and their waits keep the completion order pdl.py's rule (c) relies on. No L2 prefetch of
    the weight tile there: the hints compete with the gate/up kernel's own weight stream, which bounds both
    (bench/results/2026-12-03-h200-perf9/).

    OVERLAP (module docstring, "Overlapped split form"): the grid is (C tile, pair); a leader triggers its
    dependents at once, waits for ``ready[e] == NUM_I_TILES`` (acquire) instead of the grid-wide wait, reads h
    through L2 only (``.cg``: no stale L1 line), and passes its ``gdc_wait`` at the end, after its stores."""
    p, tile = _pair_and_tile(OVERLAP)
    e, count, leader = _scan_expert(ids_ptr, p, num_pairs, P_PAD, PAIR_TILE)
    if leader:
        c_offs = tile * BLOCK_C + tl.arange(0, BLOCK_C)
        in_c = c_offs < C
        down_rows = down_ptr + e * (C * I) + c_offs * I  # [BLOCK_C] row starts of W_down[e] [C, I]
        if OVERLAP:
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()  # the sum kernel: launched once every program has started
            while tl.atomic_add(ready_ptr + e, 0, sem="acquire", scope="gpu") < NUM_I_TILES:
                pass  # the gate/up programs of e are all resident (PDL launches this grid only after they start)
        elif PDL:
            tl.extra.cuda.gdc_wait()  # h is the previous kernel's: visible from here on
            tl.extra.cuda.gdc_launch_dependents()
        for chunk in range(MAX_CHUNKS):
            if chunk * BLOCK_M < count:
                pairs, valid = _chunk_pairs(ids_ptr, e, num_pairs, count, chunk * BLOCK_M, P_PAD, PAIR_TILE, BLOCK_M)
                acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
                for d0 in range(0, I, BLOCK_D):
                    d_offs = d0 + tl.arange(0, BLOCK_D)
                    in_d = d_offs < I
                    h = tl.load(h_ptr + pairs.to(tl.int64)[:, None] * I + d_offs[None, :],
                                mask=valid[:, None] & in_d[None, :], other=0.0,
                                cache_modifier=".cg" if OVERLAP else "")  # [BLOCK_M, BLOCK_D]
                    w = tl.load(down_rows[:, None] + d_offs[None, :], mask=in_c[:, None] & in_d[None, :],
                                other=0.0)  # [BLOCK_C, BLOCK_D], contiguous along I
                    acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
                tl.store(partials_ptr + pairs.to(tl.int64)[:, None] * C + c_offs[None, :], acc,
                         mask=valid[:, None] & in_c[None, :])
        if OVERLAP:
            if PDL:  # completes only after the gate/up grid has: what the sum kernel's wait then implies
                tl.extra.cuda.gdc_wait()


@triton.jit
def _moe_sum_kernel(partials_ptr, weights_ptr, out_ptr, ids_ptr, ready_ptr, C: tl.constexpr, TOP_K: tl.constexpr,
                    NUM_TILES: tl.constexpr, TILES_PAD: tl.constexpr, BLOCK_C: tl.constexpr, OVERLAP: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0).to(tl.int64)
    c_offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c_offs < C
    t = tl.arange(0, TILES_PAD)
    mask = (t < NUM_TILES)[:, None] & in_c[None, :]
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # fixed order: choice j, then the I tiles, so every run adds alike;
        # unrolled, so the k + 1 pairs' loads issue at once rather than one round trip each
        pair = n * TOP_K + j
        part = tl.load(partials_ptr + pair * (NUM_TILES * C) + t[:, None] * C + c_offs[None, :], mask=mask,
                       other=0.0)  # [TILES_PAD, BLOCK_C]
        acc += tl.load(weights_ptr + pair) * tl.sum(part, axis=0)
    tl.store(out_ptr + n * C + c_offs, acc.to(out_ptr.dtype.element_ty), mask=in_c)  # one rounding, at the end
    if OVERLAP:  # every down program has read its counter (this kernel waited on that grid): zero them for the next
        if tl.program_id(1) == 0:  # call; several rows may zero one expert's, all the same store
            for j in tl.static_range(TOP_K):
                tl.store(ready_ptr + tl.load(ids_ptr + n * TOP_K + j), 0)


def check_moe_inputs(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> None:
    """x [N, C], expert_ids [N, k] integer, weights [N, k], gate_up [E, 2I, C], down [E, C, I]; one float dtype."""
    if x.dim() != 2:
        raise ValueError(f"x {list(x.shape)}: expected [N, C]")
    rows, hidden = x.shape
    if gate_up.dim() != 3 or gate_up.shape[2] != hidden or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up {list(gate_up.shape)}: expected [E, 2I, {hidden}]")
    num_experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    if down.shape != (num_experts, hidden, width):
        raise ValueError(f"down {list(down.shape)}: expected [{num_experts}, {hidden}, {width}]")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != rows or expert_ids.dtype.is_floating_point:
        raise ValueError(f"expert_ids {list(expert_ids.shape)} {expert_ids.dtype}: expected integer [{rows}, k]")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {list(weights.shape)}: expected {list(expert_ids.shape)}")
    if not (x.dtype == gate_up.dtype == down.dtype) or not x.dtype.is_floating_point:
        raise ValueError(f"x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}: expected one float dtype")


def moe_experts_triton(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, *,
                       blocks: MoEBlocks | None = None, out: Tensor | None = None,
                       partials: Tensor | None = None, ready: Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> Tensor:
    """``moe_experts_torch``'s contract by the two kernels: x ``[N, C]``, expert_ids ``[N, k]``, weights
    ``[N, k]``, gate_up ``[E, 2I, C]`` (gate rows first), down ``[E, C, I]``; returns ``y [N, C]`` fp32
    (or ``out_dtype``: the fp32 sum rounded once as it is stored, which saves the model a cast).

    ``blocks`` defaults to :func:`default_blocks`. ``out`` (``out_dtype`` ``[N, C]``) and ``partials``
    (fp32 ``[N k, T, C]``, T = ceil(I / block_i), or 1 in the split form) are the buffers to write
    instead of fresh ones (static buffers of a captured graph; the tests poison them).

    ``ready`` (int32 ``[>= E]``, all zero): the per-expert counters of the overlapped split form
    (``blocks.overlap``), which the call leaves all zero again. The caller owns it (the model: one buffer a
    layer, zeroed once at load), so no call adds a zeroing launch; without it the call runs the plain split
    form, the same bits.
    """
    check_moe_inputs(x, expert_ids, weights, gate_up, down)
    rows, hidden = x.shape
    top_k = expert_ids.shape[1]
    width = gate_up.shape[1] // 2
    num_pairs = rows * top_k
    blocks = default_blocks(rows) if blocks is None else blocks
    num_tiles = 1 if blocks.split else triton.cdiv(width, blocks.block_i)
    if out is None:
        out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    elif (out.shape != (rows, hidden) or out.dtype != out_dtype or not out.is_contiguous()
          or out.device != x.device):
        raise ValueError(f"out {list(out.shape)} {out.dtype} on {out.device}: expected contiguous {out_dtype} "
                         f"[{rows}, {hidden}] on {x.device}")
    if partials is None:
        partials = torch.empty((num_pairs, num_tiles, hidden), dtype=torch.float32, device=x.device)
    elif (partials.shape != (num_pairs, num_tiles, hidden) or partials.dtype != torch.float32
          or not partials.is_contiguous() or partials.device != x.device):
        raise ValueError(f"partials {list(partials.shape)} {partials.dtype} on {partials.device}: expected "
                         f"contiguous fp32 [{num_pairs}, {num_tiles}, {hidden}] on {x.device}")
    if ready is not None and (ready.dtype != torch.int32 or ready.dim() != 1 or ready.shape[0] < gate_up.shape[0]
                              or ready.device != x.device):
        raise ValueError(f"ready {list(ready.shape)} {ready.dtype} on {ready.device}: expected int32 "
                         f"[>= {gate_up.shape[0]}] on {x.device}, all zero")
    overlap = blocks.split and blocks.overlap and ready is not None
    if not overlap:
        ready = partials  # not read: the kernels' OVERLAP branches are not compiled
    if num_pairs == 0:
        return out.zero_()
    x, gate_up, down, ids = (t.contiguous() for t in (x, gate_up, down, expert_ids))  # the model's are already
    weights = weights.to(torch.float32).contiguous()
    pairs_pad = triton.next_power_of_2(num_pairs)
    pair_tile = min(blocks.pair_tile, pairs_pad)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32; tf32 is unused for bf16/fp16
    launch = dict(PDL=pdl_enabled(x.device), **launch_options(x.device))
    scan = dict(P_PAD=pairs_pad, PAIR_TILE=pair_tile, MAX_CHUNKS=triton.cdiv(pairs_pad, blocks.block_m),
                BLOCK_M=blocks.block_m, DOT_PRECISION=precision, num_warps=blocks.num_warps,
                num_stages=blocks.num_stages, **launch)
    if blocks.split:
        h = torch.empty((num_pairs, width), dtype=down.dtype, device=x.device)  # [P, I]: L2-resident between the two
        i_tiles, c_tiles = triton.cdiv(width, blocks.block_i), triton.cdiv(hidden, blocks.block_c)
        _moe_gate_up_kernel[(i_tiles, num_pairs) if overlap else (num_pairs, i_tiles)](
            x, ids, gate_up, h, ready, num_pairs, C=hidden, I=width, TOP_K=top_k, BLOCK_I=blocks.block_i,
            BLOCK_K=blocks.block_k, OVERLAP=overlap, **scan)
        _moe_down_kernel[(c_tiles, num_pairs) if overlap else (num_pairs, c_tiles)](
            ids, h, down, partials, ready, num_pairs, C=hidden, I=width, NUM_I_TILES=i_tiles, BLOCK_C=blocks.block_c,
            BLOCK_D=blocks.block_d, OVERLAP=overlap, **scan)
    else:
        _moe_expert_tile_kernel[(num_pairs, num_tiles)](
            x, ids, gate_up, down, partials, num_pairs, C=hidden, I=width, TOP_K=top_k, NUM_TILES=num_tiles,
            BLOCK_I=blocks.block_i, BLOCK_K=blocks.block_k, BLOCK_C=blocks.block_c, **scan)
    _moe_sum_kernel[(rows, triton.cdiv(hidden, blocks.sum_block_c))](
        partials, weights, out, ids, ready, C=hidden, TOP_K=top_k, NUM_TILES=num_tiles,
        TILES_PAD=triton.next_power_of_2(num_tiles), BLOCK_C=blocks.sum_block_c, OVERLAP=overlap, **launch)
    return out


def moe_experts_torch(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Weighted sum of each row's chosen experts.

    x: ``[N, C]``; expert_ids: ``[N, k]`` long; weights: fp32 ``[N, k]``; gate_up: ``[E, 2I, C]``
    (gate rows first); down: ``[E, C, I]``. Returns fp32 ``[N, C]``, the experts added in
    ascending expert order per row. Reads the per-expert counts on the host (one sync).
    """
    num_experts, top_k = gate_up.shape[0], expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [N k]
    order = torch.argsort(flat, stable=True)  # (row, choice) pairs grouped by expert
    rows = order // top_k
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # host sync: the group sizes
    xs = x[rows]  # [N k, C]
    outs = torch.empty(xs.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            outs[start:start + count] = swiglu(xs[start:start + count], gate_up[e], down[e]).float()
            start += count
    weighted = outs * weights.reshape(-1)[order, None]  # [N k, C]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, rows, weighted)


from . import moe_grouped  # noqa: E402 - after the names it takes from this module (it imports this one first)


def moe_experts_gpu(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """The op's GPU form: this module's kernels up to :data:`MAX_TRITON_PAIRS` (row, choice) pairs (decode and
    verify steps), the grouped GEMM of ``moe_grouped.py`` above (prefill chunks). Chosen here by the pair count,
    not by two forms' ``fits``: inside a CUDA-graph capture the op takes its first GPU form whatever its ``fits``
    (fast/kernels/common/dispatch.py), and a captured step must run the kernels an eager one of its size runs."""
    if expert_ids.numel() <= MAX_TRITON_PAIRS:
        return moe_experts_triton(x, expert_ids, weights, gate_up, down)
    return moe_grouped.moe_experts_grouped(x, expert_ids, weights, gate_up, down)


# CUDA tensors go to the sync-free kernels at every size (moe_experts_gpu), so the op is capturable; the torch
# form (a host read of the counts) runs on the CPU
moe_experts = KernelOp("moe_experts", moe_experts_torch, GpuForm(moe_experts_gpu), torch_capturable=False)
