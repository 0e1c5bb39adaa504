"""The routed experts of a long prefill as a grouped GEMM: the (row, choice) pairs sorted by expert into
blocks of ``block_m`` rows, one tensor-core GEMM tile per (block, output tile). Twin of
``reference/model/moe.routed_experts`` and of :func:`~.moe.moe_experts_torch` (the op's torch form); the GPU
form of the op :data:`~.moe.moe_experts` above :data:`~.moe.MAX_TRITON_PAIRS` pairs, where the per-pair kernels
of ``moe.py`` (each program scans the P pair ids: cost P^2) stop paying. vLLM's fused_moe and SGLang sort
tokens by expert the same way; this is its own code.

N rows, k choices each, E experts of width I, hidden C, pairs ``p = n k + j`` (P = N k; pair p is row n)::

    alignment: the pairs sorted by expert (ascending p within one), each expert's segment padded with the
               sentinel P to a multiple of block_m; the expert of each block; the number of valid blocks
    kernel 1, one program per (block b of expert e, I tile):  h[b m + i] = silu(W_gate[e] x_n) * (W_up[e] x_n)
               ([block_m, block_i] of h [P_pad, I], in the weights' dtype, as moe.py's forms round it)
    kernel 2, one program per (block b of expert e, C tile):  partials[p] = W_down[e] h_p   fp32 [P, C]
               (written at the pair's own index p, not its padded position)
    sum:       y_n = sum_j weights[n, j] partials[n k + j]      fp32, j = 0 .. k-1 in that order
               (moe.py's sum kernel with one tile; rounded once to ``out_dtype`` as it is stored)

``P_pad = max_blocks * block_m``, ``max_blocks = (P + min(E, P) (block_m - 1)) // block_m``: each of at most
min(E, P) chosen experts pads its count by at most block_m - 1, and the padded total is a multiple of block_m.
Every buffer and grid depends on (N, k, E, C, I, blocks) only; the programs of blocks past the valid count
exit at once. No host sync, no data-dependent shape: capturable in a CUDA graph.

Determinism: every partial is written by exactly one program, h and partials at fixed addresses; a row of a
tile's product depends only on that row's inputs (the other rows of its block do not enter its sums); the sum
adds the k choices in a fixed order. No atomics: two calls are bitwise equal, and a CUDA-graph replay equals
the eager call. The grouped form rounds differently from moe.py's forms (C in block_k steps, then I in
block_k steps), within NUMERIC of the reference.

What bounds it: ``2 P (2 I C + C I)`` FLOPs on the tensor cores (206 GFLOP at the 35B-A3B's N = 4096, k = 8,
C = 2048, I = 512), and the weights of every chosen expert read once, ``E (3 I C) x 2`` bytes (1.5 GiB at E =
256, bf16): at prefill sizes both are of the same order, so the floor is the larger of the two. An expert's
blocks are consecutive in the grid and each block's I (C) tiles run together, so the second block of an
expert finds its weights in L2. The fp32 partials add ``2 P C x 4`` bytes (0.5 GiB at N = 4096).
bench/kernels/bench_moe.py (``--prefill``) measures the fraction of the floor reached.

A precondition that cannot be checked without a sync: every id in ``[0, E)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from ..common.pdl import launch_options, pdl_enabled
from ..common.triton_compat import tl, triton
from . import moe as per_pair  # check_moe_inputs and the sum kernel (moe.py imports this module back at its end)


@dataclass(frozen=True)
class GroupedBlocks:
    """Block sizes of the grouped kernels (powers of two; the tl.dot ones at least 16). The defaults are meant for
    Hopper at prefill sizes: 64-row blocks (an expert of the 35B-A3B gets 128 rows on average at N = 4096), two
    [64, 64] fp32 accumulators in the gate/up kernel and one [64, 128] in the down kernel (64 registers a thread
    at 4 warps each), 3 stages of 24 KiB of operands in shared memory. Not yet swept on a GPU."""

    block_m: int = 64  # pairs per block (rows of the tl.dot); each expert's segment is padded to a multiple
    block_i: int = 64  # the I tile of a gate/up program (its W_gate and W_up rows)
    block_c: int = 128  # the C tile of a down program
    block_k: int = 64  # the reduction step of both kernels (over C in gate/up, over I in down)
    num_warps: int = 4
    num_stages: int = 3
    sum_block_c: int = 128  # C tile of the sum kernel

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            least = 16 if f.name in ("block_m", "block_i", "block_c", "block_k") else 1
            if f.name == "num_stages":
                ok = isinstance(value, int) and value >= 1
                want = "an int >= 1"
            else:
                ok = isinstance(value, int) and value >= least and value & (value - 1) == 0
                want = f"a power of two >= {least}"
            if not ok:
                raise ValueError(f"GroupedBlocks.{f.name} = {value!r}: expected {want}")


class ExpertAlignment(NamedTuple):
    """The pairs grouped by expert in blocks of ``block_m`` (module docstring), sizes fixed by (P, E, block_m)."""

    sorted_pairs: Tensor  # int32 [max_blocks * block_m]: pair ids by expert, ascending within one; P pads
    block_experts: Tensor  # int32 [max_blocks]: the expert of each block; -1 past the valid blocks
    num_blocks: Tensor  # int32 [1]: the valid blocks


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks P pairs over E experts can need: each chosen expert (at most min(E, P)) pads its count by at
    most block_m - 1, and the padded total is a multiple of block_m."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def align_by_expert(expert_ids: Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """:class:`ExpertAlignment` of expert_ids ``[N, k]`` by torch ops that read nothing on the host (a stable sort,
    searchsorted, cumsum, one scatter to distinct positions): no sync, capturable, deterministic."""
    if not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m {block_m!r}: expected an int >= 1")
    flat = expert_ids.reshape(-1)  # [P]
    num_pairs, device = flat.numel(), flat.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids, order = torch.sort(flat, stable=True)  # [P]: ascending expert, ascending pair within one
    experts = torch.arange(num_experts + 1, dtype=sorted_ids.dtype, device=device)
    starts = torch.searchsorted(sorted_ids, experts)  # [E + 1]: each expert's first sorted position (and P)
    counts = starts[1:] - starts[:-1]  # [E]
    padded = torch.div(counts + block_m - 1, block_m, rounding_mode="floor") * block_m  # [E] multiples of block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    rank = torch.arange(num_pairs, device=device) - starts[sorted_ids]  # [P]: each sorted pair's rank in its expert
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[sorted_ids] + rank] = order.to(torch.int32)  # distinct positions: no order to race
    block_ids = torch.arange(blocks, device=device)
    # block b belongs to the expert whose padded segment holds position b m: the number of segments ending at or
    # before it (an expert with no pairs has an empty segment, counted and skipped alike)
    block_experts = torch.searchsorted(padded_end, block_ids * block_m, right=True)  # [max_blocks]
    num_blocks = torch.div(padded_end[-1:], block_m, rounding_mode="floor")  # [1]
    block_experts = torch.where(block_ids < num_blocks, block_experts, -1)
    return ExpertAlignment(sorted_pairs, block_experts.to(torch.int32), num_blocks.to(torch.int32))


def align_by_expert_torch(expert_ids: Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """:func:`align_by_expert` written out: expert by expert, its pairs in ascending order, then the padding
    (reads the ids on the host)."""
    flat = expert_ids.reshape(-1).tolist()
    num_pairs = len(flat)
    pairs: list[int] = []
    experts: list[int] = []
    for e in range(num_experts):
        mine = [p for p, chosen in enumerate(flat) if chosen == e]
        if mine:
            pad = -len(mine) % block_m
            pairs += mine + [num_pairs] * pad
            experts += [e] * ((len(mine) + pad) // block_m)
    blocks = max_blocks(num_pairs, num_experts, block_m)
    pairs += [num_pairs] * (blocks * block_m - len(pairs))
    num_valid = len(experts)
    experts += [-1] * (blocks - num_valid)

    def as_int32(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=expert_ids.device)

    return ExpertAlignment(as_int32(pairs), as_int32(experts), as_int32([num_valid]))


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit
def _block_and_tile(num_blocks_ptr, block_experts_ptr, sorted_pairs_ptr, num_pairs, NUM_TILES: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """This program's block and tile (the tiles of a block are adjacent in launch order, and the blocks of an
    expert too: its weights and the block's rows are read from L2 after the first program), the block's expert,
    its pair ids [BLOCK_M] and which are real (not the sentinel); ``live`` is False past the valid blocks."""
    pid = tl.program_id(0)
    block = pid // NUM_TILES
    tile = pid % NUM_TILES
    live = block < tl.load(num_blocks_ptr)
    e = tl.load(block_experts_ptr + block).to(tl.int64)
    slots = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions in the sorted order
    pairs = tl.load(sorted_pairs_ptr + slots)
    return live, tile, e, slots, pairs, pairs < num_pairs


@triton.jit(do_not_specialize=["num_pairs"])  # one compile serves every chunk size: none at a new size mid-serve
def _grouped_gate_up_kernel(x_ptr, gate_up_ptr, h_ptr, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
                            num_pairs, C: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                            NUM_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                            BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    live, tile, e, slots, pairs, valid = _block_and_tile(num_blocks_ptr, block_experts_ptr, sorted_pairs_ptr,
                                                         num_pairs, NUM_TILES, BLOCK_M)
    if live:
        rows = (pairs // TOP_K).to(tl.int64)  # [BLOCK_M] the rows of x the block gathers
        i_offs = tile * BLOCK_I + tl.arange(0, BLOCK_I)
        in_i = i_offs < I
        gate_rows = gate_up_ptr + e * (2 * I * C) + i_offs.to(tl.int64) * C  # [BLOCK_I] rows of W_gate[e] [I, C]
        up_rows = gate_rows + I * C  # W_up[e]: rows I .. 2I - 1 of gate_up[e]
        acc_gate = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
        for k0 in range(0, C, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            in_k = k_offs < C
            a = tl.load(x_ptr + rows[:, None] * C + k_offs[None, :], mask=valid[:, None] & in_k[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w_mask = in_k[:, None] & in_i[None, :]
            w_gate = tl.load(gate_rows[None, :] + k_offs[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_I]
            w_up = tl.load(up_rows[None, :] + k_offs[:, None], mask=w_mask, other=0.0)
            acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [BLOCK_M, BLOCK_I]; 0 in the padding rows
        # the padding rows too: the down kernel's tl.dot then reads a whole written tile (it masks them anyway)
        tl.store(h_ptr + slots[:, None] * I + i_offs[None, :], h.to(h_ptr.dtype.element_ty), mask=in_i[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # one compile serves every chunk size: none at a new size mid-serve
def _grouped_down_kernel(h_ptr, down_ptr, partials_ptr, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
                         num_pairs, C: tl.constexpr, I: tl.constexpr, NUM_TILES: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    live, tile, e, slots, pairs, valid = _block_and_tile(num_blocks_ptr, block_experts_ptr, sorted_pairs_ptr,
                                                         num_pairs, NUM_TILES, BLOCK_M)
    if live:
        c_offs = tile * BLOCK_C + tl.arange(0, BLOCK_C)
        in_c = c_offs < C
        down_rows = down_ptr + e * (C * I) + c_offs.to(tl.int64) * I  # [BLOCK_C] rows of W_down[e] [C, I]
        acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            in_k = k_offs < I
            h = tl.load(h_ptr + slots[:, None] * I + k_offs[None, :], mask=valid[:, None] & in_k[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(down_rows[None, :] + k_offs[:, None], mask=in_k[:, None] & in_c[None, :],
                        other=0.0)  # [BLOCK_K, BLOCK_C], contiguous along I
            acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        tl.store(partials_ptr + pairs.to(tl.int64)[:, None] * C + c_offs[None, :], acc,
                 mask=valid[:, None] & in_c[None, :])


def moe_experts_grouped(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, *,
                        blocks: GroupedBlocks | None = None, out: Tensor | None = None, h: Tensor | None = None,
                        partials: Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """``moe_experts_torch``'s contract by the grouped kernels: x ``[N, C]``, expert_ids ``[N, k]``, weights
    ``[N, k]``, gate_up ``[E, 2I, C]`` (gate rows first), down ``[E, C, I]``; returns ``y [N, C]`` fp32 (or
    ``out_dtype``: the fp32 sum rounded once as it is stored).

    ``blocks`` defaults to :class:`GroupedBlocks`' defaults. ``out`` (``out_dtype`` ``[N, C]``), ``h`` (the
    weights' dtype, ``[P_pad, I]``, module docstring) and ``partials`` (fp32 ``[N k, C]``) are buffers to write
    instead of fresh ones (the tests poison them)."""
    per_pair.check_moe_inputs(x, expert_ids, weights, gate_up, down)
    blocks = GroupedBlocks() if blocks is None else blocks
    rows, hidden = x.shape
    num_experts, top_k, width = gate_up.shape[0], expert_ids.shape[1], gate_up.shape[1] // 2
    num_pairs = rows * top_k
    padded = max_blocks(num_pairs, num_experts, blocks.block_m) * blocks.block_m
    for name, buf, shape, dtype in (("out", out, (rows, hidden), out_dtype), ("h", h, (padded, width), down.dtype),
                                    ("partials", partials, (num_pairs, hidden), torch.float32)):
        if buf is not None and (buf.shape != shape or buf.dtype != dtype or not buf.is_contiguous()
                                or buf.device != x.device):
            raise ValueError(f"{name} {list(buf.shape)} {buf.dtype} on {buf.device}: expected contiguous {dtype} "
                             f"{list(shape)} on {x.device}")
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device) if out is None else out
    if num_pairs == 0:
        return out.zero_()
    h = torch.empty((padded, width), dtype=down.dtype, device=x.device) if h is None else h
    partials = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device) if partials is None else partials
    x, gate_up, down = (t.contiguous() for t in (x, gate_up, down))  # the model's are already
    weights = weights.to(torch.float32).contiguous()
    sorted_pairs, block_experts, num_blocks = align_by_expert(expert_ids, num_experts, blocks.block_m)
    grid_blocks = padded // blocks.block_m
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32; tf32 is unused for bf16/fp16
    common = dict(BLOCK_M=blocks.block_m, BLOCK_K=blocks.block_k, DOT_PRECISION=precision,
                  num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    i_tiles, c_tiles = triton.cdiv(width, blocks.block_i), triton.cdiv(hidden, blocks.block_c)
    _grouped_gate_up_kernel[(grid_blocks * i_tiles,)](
        x, gate_up, h, sorted_pairs, block_experts, num_blocks, num_pairs, C=hidden, I=width, TOP_K=top_k,
        NUM_TILES=i_tiles, BLOCK_I=blocks.block_i, **common)
    _grouped_down_kernel[(grid_blocks * c_tiles,)](
        h, down, partials, sorted_pairs, block_experts, num_blocks, num_pairs, C=hidden, I=width,
        NUM_TILES=c_tiles, BLOCK_C=blocks.block_c, **common)
    # moe.py's sum kernel with one tile a pair: y_n = sum_j weights[n, j] partials[n k + j], j in order; its
    # OVERLAP branch (the ids and ready counters) is not compiled
    per_pair._moe_sum_kernel[(rows, triton.cdiv(hidden, blocks.sum_block_c))](
        partials, weights, out, partials, partials, C=hidden, TOP_K=top_k, NUM_TILES=1, TILES_PAD=1,
        BLOCK_C=blocks.sum_block_c, OVERLAP=False, PDL=pdl_enabled(x.device), **launch_options(x.device))
    return out
