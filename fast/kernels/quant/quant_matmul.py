"""``y = x @ W^T`` for a few rows of x (decode and verify: N <= 64) with W a GGUF-quantized matrix read as its
bytes (:class:`~.layout.QuantWeight`), fused: no dequantized copy of W is ever written. Twin: the torch form
``quant_matmul_torch`` (dequantize to x's dtype, then the matmul).

x ``[N, K]`` (fp32, fp16 or bf16), W ``[R, K]`` quantized (R outputs, K inputs, whole blocks) -> y ``[N, R]`` in
x's dtype::

    y[n, r] = sum_k x[n, k] w[r, k],   w = dequantize(W),   fp32 accumulation

Why fused: at a few rows the product is a stream of W's bytes, 3-8.5 bits a value; a dequantized bf16 copy
would be written and read again at 16. So the kernel's budget is the decode's instructions: an H100 streams
about 6 G 4-bit values a millisecond and issues about 33 T lane-instructions a second, so a value may cost
about 5 instructions (4 at IQ3_XXS's 3.06 bits) before the bytes stop being the bound. The first version spent
16-18 (a byte load, a shift and an ``I2F``, at 1/8 of the FP32 rate, a value, a cross-thread sum every tile).
Here (``dequant_triton``'s "word decoders"): the payload is read as int32 words, a field becomes a float by the
exponent trick (one LOP3 and one FADD: ``_field``), and each path keeps per-value work to that plus an FMA.

One row (decode; the routed experts' pairs), three paths by type:

- Q4_K, Q5_K (``_gemv_k``): the nibbles are used where they lie in their words, x loaded in the matching
  permuted order, and with ``S = d sc``, ``M = dmin m`` per 32-value sub-block j::

      sum_e w_e x_e = sum_j S_j (sum_p q_p x_p) - M_j X_j,   X_j = sum_p x_p

  so a value is a LOP3, an FADD and an FMA into its sub-block's chain; S goes on per thread and sub-block, M
  through X_j (shared by the thread's 8 rows). Measured statically (sm_90 SASS of the loop, ptxas of Triton
  3.6): 5.5 lane-instructions a value at Q4_K, 6.9 at Q5_K (16.5 before).
- IQ3_XXS (``_gemv_iq3_xxs``): per grid word one table gather and ``(G ^ N) + A``, the four signed magnitudes
  in offset binary (``tables.iq3xxs_sign_words``, one 16-byte lookup per 8 values), then the same three
  instructions a value: 7.9 (18.5 before).
- Q8_0, Q6_K, IQ4_XS (``_gemv_tile``, 6.6-8.5 bits, twice the instruction budget a value): the natural-order tile
  ``dequant_triton._word_tile`` times x into an elementwise accumulator: 9.5-11.8.

Every path keeps an fp32 accumulator over its K range and reduces across threads once, at the end.

Several rows (verify, 2-64; ``BLOCK_M`` 16-64, padded): the tile ``_word_tile`` (fp32, the twin's values)
decoded once into registers, rounded to x's dtype and multiplied with every x row by one ``tl.dot``, W as the
left operand, so at BLOCK_R = 64 and 4 warps the tile feeds Hopper's wgmma from registers: 6.2 a value at Q4_K
for 16 rows and 6.9 for 64 (its 1-row cost and a little: 8 rows cost about one row's weight stream), 10.3 at
IQ3_XXS (its tile, still staged through shared memory a value a store, is the next thing to fix).

Rounding. The verify path rounds W to x's dtype as the twin does, so it differs from the twin by summation
order only. The one-row paths never round W: the Q4_K/Q5_K/IQ3_XXS paths factor the per-sub-block scales out
of the sum (and IQ3_XXS's offset 64 out as ``64 X_j``), the tile path multiplies the fp32 value; each product is
exact in fp32 up to its one rounding, so they are closer to the exact product than the twin (which rounds each
w to bf16 first): the NUMERIC bound holds with room (conformance/ops/test_quant_linear.py prints the fraction
used: below 12% of it for every type and dtype).

Grid ``(cdiv(R, BLOCK_R), SPLIT_K, cdiv(N, BLOCK_M))``: one program owns BLOCK_R rows of W (outputs), one of
SPLIT_K ranges of its 256-value tiles, one BLOCK_M tile of x's rows. Split-K is skinny_linear's (no float atomics,
no second kernel): each program stores its fp32 partial to a workspace, takes a ticket from its output tile's
counter (``fast/kernels/common/tickets.py``); the last to arrive sums the partials in split order, writes y and
resets the counter, so the bits are the same on every call and in a CUDA-graph replay. Nothing is allocated
that depends on the data, and nothing is read on the host.

Routed experts (``quant_matmul_experts``): W stacked ``[E, R, K]``, x ``[P, K]`` one row a (token, expert) pair and
``expert_ids [P]``; the same kernel, one x row a program column, each program offsetting W by its pair's expert
(read on the device), so a decode MoE layer is two launches (gate|up, then down) reading only the chosen
experts' bytes. Twin: one dequantize + matmul per expert present (a host sync).

Bound: W's bytes where the instruction counts above fit the budget, else the decode's issue rate. The config
(:func:`default_config`) is a rule, not a measurement: bench/kernels/bench_quant_linear.py measures it (and a
sweep) against the bytes' floor at the released models' shapes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from ..common.pdl import launch_options, pdl_enabled
from ..common.tickets import ticket_counters
from ..common.triton_compat import tl, triton
from .dequant_torch import dequantize_torch
from .dequant_triton import MAGIC, TILE, _f16_at, _f16_hi, _f16_lo, _field, _k_scale_words, _word_tile
from .layout import QUANT_TYPES, Q, QuantWeight, block_shape
from .tables import iq_tables

MAX_ROWS = 64  # the kernel's domain: x rows at most this (one or more BLOCK_M tiles of at most 64)
X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class QuantMatmulConfig:
    """Tiling of one call: BLOCK_R output rows a program (a power of two, >= 16 for ``tl.dot``), K split in
    ``split_k`` ranges of whole 256-value tiles, ``num_warps`` warps a program."""

    block_r: int = 32
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1


def default_config(rows: int, r: int, k: int, qtype) -> QuantMatmulConfig:
    """A rule, UNMEASURED until ``bench/kernels/bench_quant_linear.py --sweep`` runs on a GPU (the command is in its
    docstring). One row (decode; the routed experts' pairs): Q4_K, Q5_K and IQ3_XXS take their word paths in
    64-row programs of two warps (each thread 8 rows: x's loads and the per-sub-block work shared by 8 rows, at
    about 200 registers); the other types the tile path in 32-row programs of four warps (its ``[32, 256]`` tile
    is 64 values a thread). Several rows (verify): 64-row tiles of four warps (one warpgroup: the M of a wgmma,
    W's tile its register operand). K is split while the programs stay within about 8 (one row) or 2 (several)
    an SM of an H100 (``_split``)."""
    one_row = rows <= 1
    word_path = one_row and Q(qtype) in (Q.Q4_K, Q.Q5_K, Q.IQ3_XXS)
    block_r, warps = (64, 2) if word_path else ((32, 4) if one_row else (64, 4))
    tiles = triton.cdiv(r, block_r) * (1 if one_row else triton.cdiv(rows, MAX_ROWS))
    return QuantMatmulConfig(block_r=block_r, num_warps=warps,
                             split_k=_split(tiles, triton.cdiv(k, TILE), 1024 if one_row else 256))


def _split(tiles: int, k_tiles: int, target: int) -> int:
    """K's split: doubled while ``tiles`` programs times it stay within ``target`` and a split keeps 2 tiles of 256
    values, or 1 while there are fewer programs than 2 an SM (264; the MoE's short experts: K of 2 and 8 tiles)."""
    split = 1
    while split < 16 and tiles * split * 2 <= target:
        per_split = 1 if tiles * split < 264 else 2
        if k_tiles < split * 2 * per_split:
            break
        split *= 2
    return split


# -- one row of x: the weight's values never leave their words -----------------------------------------------

@triton.jit
def _quads(v, BLOCK_R: tl.constexpr, G: tl.constexpr):
    """``[BLOCK_R, G, 8] -> [BLOCK_R, G, 2]``: the sums of 4 consecutive words (one thread's, in the layout of a
    16-byte load of the 8 words: no shuffle)."""
    return tl.sum(tl.reshape(v, (BLOCK_R, G, 2, 4)), axis=3)


@triton.jit
def _gemv_k(w32, row_w, in_r, x_row, t0, magic, QTYPE: tl.constexpr, NUM_T: tl.constexpr,
            T_PER_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr):
    """``sum_k x[k] w[r, k]`` over tiles ``t0 ..`` of BLOCK_R Q4_K (12) or Q5_K (13) rows: ``[BLOCK_R]`` fp32.

    The 32 words of a block's nibbles are ``[BLOCK_R, 4 pairs i, 8 words w]``; byte b of word (i, w) holds value
    ``p = 4 w + b`` of sub-block 2 i (low nibble) and of 2 i + 1 (high). Each nibble is read where it lies (masks at
    bits 0, 4, 8, 12, 16 of the word, 8, 12, 16 of the word shifted by 12: ``_field``, one LOP3 and one FADD), x at
    the matching permuted offsets, and with ``S = d sc[j]``, ``M = dmin m[j]``, ``X_j = sum_p x_p``::

        sum_e w_e x_e = sum_j S_j (sum_p q_p x_p) - M_j X_j

    so a value costs its LOP3, FADD and one FMA into the sub-block's chain; the scales are applied once per
    thread and sub-block, the min once per sub-block through X_j (shared by the thread's 8 rows). Q5_K's fifth
    bit is OR'd into each byte first (bit j of qh byte p). The chains are reduced across threads once, at the end.
    """
    BLOCK_W: tl.constexpr = 36 if QTYPE == 12 else 44
    c = tl.arange(0, 32)[None, :]
    i = tl.arange(0, 4)[None, :, None]
    xo = 64 * i + 4 * tl.arange(0, 8)[None, None, :]  # [1, 4, 8]: x of word (i, w)'s byte 0, low nibble
    m4 = magic - (4 << 23)
    m8 = magic - (8 << 23)
    m12 = magic - (12 << 23)
    m16 = magic - (16 << 23)
    acc = tl.zeros([BLOCK_R, 4, 2], dtype=tl.float32)
    for s in range(T_PER_SPLIT):
        t = t0 + s
        live = t < NUM_T  # the last split may be short: its missing tiles read as zeros
        mask = in_r & live
        blk = w32 + row_w + BLOCK_W * t  # [BLOCK_R, 1]
        w = tl.reshape(tl.load(blk + (BLOCK_W - 32) + c, mask=mask, other=0), (BLOCK_R, 4, 8))
        # the 4 header words, loaded in the words' layout (each thread its rows' 16 bytes) and split there
        hw = tl.reshape(tl.load(blk + c % 4, mask=mask, other=0), (BLOCK_R, 4, 2, 2, 2))
        h02, h13 = tl.split(hw)
        h0, h2 = tl.split(h02)
        h1, h3 = tl.split(h13)  # [BLOCK_R, 4, 2]
        sc, mn = _k_scale_words(h0, h1, h2, h3, i)
        sc = sc >> (16 * (i % 2))  # sub-blocks 2 i, 2 i + 1: bytes 0 and 1
        mn = mn >> (16 * (i % 2))
        d = _f16_lo(h0)
        dmin = _f16_hi(h0)
        s0 = d * _field(sc, 0x3F, magic, 8388608.0)
        s1 = d * _field(sc, 0x3F00, m8, 32768.0)
        n0 = dmin * _field(mn, 0x3F, magic, 8388608.0)
        n1 = dmin * _field(mn, 0x3F00, m8, 32768.0)
        xp = x_row + 256 * t + xo
        x0 = tl.load(xp, mask=live, other=0.0).to(tl.float32)
        x1 = tl.load(xp + 1, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(xp + 2, mask=live, other=0.0).to(tl.float32)
        x3 = tl.load(xp + 3, mask=live, other=0.0).to(tl.float32)
        y0 = tl.load(xp + 32, mask=live, other=0.0).to(tl.float32)
        y1 = tl.load(xp + 33, mask=live, other=0.0).to(tl.float32)
        y2 = tl.load(xp + 34, mask=live, other=0.0).to(tl.float32)
        y3 = tl.load(xp + 35, mask=live, other=0.0).to(tl.float32)
        if QTYPE == 12:
            w12 = w >> 12
            a = _field(w, 0xF, magic, 8388608.0) * x0  # one FMA chain a sub-block
            a += _field(w, 0xF00, m8, 32768.0) * x1
            a += _field(w, 0xF0000, m16, 128.0) * x2
            a += _field(w12, 0xF000, m12, 2048.0) * x3
            b = _field(w, 0xF0, m4, 524288.0) * y0
            b += _field(w, 0xF000, m12, 2048.0) * y1
            b += _field(w12, 0xF00, m8, 32768.0) * y2
            b += _field(w12, 0xF0000, m16, 128.0) * y3
        else:
            qh = tl.reshape(tl.load(blk + 4 + c % 8, mask=mask, other=0), (BLOCK_R, 4, 8)) >> (2 * i)
            f0 = (w & 0x0F0F0F0F) | ((qh << 4) & 0x10101010)  # bytes: the 5-bit q of sub-block 2 i
            f1 = ((w >> 4) & 0x0F0F0F0F) | ((qh << 3) & 0x10101010)  # of sub-block 2 i + 1
            a = _field(f0, 0x1F, magic, 8388608.0) * x0
            a += _field(f0, 0x1F00, m8, 32768.0) * x1
            a += _field(f0, 0x1F0000, m16, 128.0) * x2
            a += _field(f0 >> 8, 0x1F0000, m16, 128.0) * x3
            b = _field(f1, 0x1F, magic, 8388608.0) * y0
            b += _field(f1, 0x1F00, m8, 32768.0) * y1
            b += _field(f1, 0x1F0000, m16, 128.0) * y2
            b += _field(f1 >> 8, 0x1F0000, m16, 128.0) * y3
        acc += (s0 * _quads(a, BLOCK_R, 4) + s1 * _quads(b, BLOCK_R, 4)
                - n0 * _quads(x0 + x1 + x2 + x3, 1, 4) - n1 * _quads(y0 + y1 + y2 + y3, 1, 4))
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _words_at(w32, a, cols, mask):
    """``[G, BLOCK_R]``: the int32 words at byte offsets ``a + 4 cols`` (``a [1, BLOCK_R]`` even, ``cols [G, 1]``
    contiguous), funnel-shifted from the aligned words when ``a`` is 2 mod 4 (``dequant_triton._word_at``; here the
    aligned word index is ``a >> 2`` plus the column, so the loads are contiguous along G)."""
    base = w32 + (a >> 2) + cols
    lo = tl.load(base, mask=mask, other=0)
    hi = tl.load(base + 1, mask=mask & ((a & 2) != 0), other=0)
    return (((hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)) >> ((a & 2) * 8)).to(tl.int32)


@triton.jit
def _gemv_iq3_xxs(w32, row_b, in_r, x_row, t0, magic, grid_ptr, sign_ptr, NUM_T: tl.constexpr,
                  T_PER_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr):
    """``sum_k x[k] w[r, k]`` over tiles ``t0 ..`` of BLOCK_R IQ3_XXS rows (``row_b``, ``in_r``: ``[1, BLOCK_R]``):
    ``[BLOCK_R]`` fp32.

    Everything is ``[8 sub-blocks j, BLOCK_R]``, unrolled over the sub-block's 8 grid words k and their 4 values m,
    so a thread holds whole sub-blocks of several rows: their sign word and scale read once, x shared by the rows.
    (j leads: where no axis is contiguous, as in the gathers, Triton puts threads on the leading axis first, and
    every tensor here must share one layout.) Per grid word: the index byte, one 1 KiB-table gather, and
    ``(G ^ N) + A`` (``tables.iq3xxs_sign_words``, one 16-byte lookup per two grid words): the four signed
    magnitudes as 64 + s m in offset binary (7 bits). Per value: ``_field`` (LOP3, FADD) and one FMA into the
    sub-block's chain; ``sum 64 x`` comes off once per sub-block, the scale ``db`` goes on once."""
    j = tl.arange(0, 8)[:, None]
    m8 = magic - (8 << 23)
    m16 = magic - (16 << 23)
    sign_cols = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([8, BLOCK_R], dtype=tl.float32)
    for s in range(T_PER_SPLIT):
        t = t0 + s
        live = t < NUM_T
        mask = in_r & live
        a = row_b + 98 * t  # [1, BLOCK_R] bytes
        sw = _words_at(w32, a + 66, j, mask)  # [8, BLOCK_R]
        db = _f16_at(w32, a, mask) * (0.5 + ((sw >> 28) & 15).to(tl.float32)) * 0.5
        q0 = _words_at(w32, a + 2, 2 * j, mask)
        q1 = _words_at(w32, a + 6, 2 * j, mask)
        xs = x_row + 256 * t + 32 * j  # [8, 1]
        chain = tl.zeros([8, BLOCK_R], dtype=tl.float32)
        xsum = tl.zeros([8, 1], dtype=tl.float32)
        for k in tl.static_range(8):
            if k % 2 == 0:  # the sign byte of values 8 (k / 2) .. + 7: [N_lo, A_lo, N_hi, A_hi]
                sidx = (sw >> (7 * (k // 2))) & 127
                nw = tl.reshape(tl.load(sign_ptr + 4 * sidx[:, :, None] + sign_cols), (8, BLOCK_R, 2, 2))
                n_half, a_half = tl.split(nw)
                n_lo, n_hi = tl.split(n_half)
                a_lo, a_hi = tl.split(a_half)
                n = n_lo
                add = a_lo
            else:
                n = n_hi
                add = a_hi
            if k < 4:
                idx = (q0 >> (8 * k)) & 255
            else:
                idx = (q1 >> (8 * (k - 4))) & 255
            u = (tl.load(grid_ptr + idx) ^ n) + add
            u8 = u >> 8
            for m in tl.static_range(4):
                xv = tl.load(xs + 4 * k + m, mask=live, other=0.0).to(tl.float32)
                xsum += xv
                if m == 0:
                    f = _field(u, 0x7F, magic, 8388608.0)
                elif m == 1:
                    f = _field(u, 0x7F00, m8, 32768.0)
                elif m == 2:
                    f = _field(u, 0x7F0000, m16, 128.0)
                else:
                    f = _field(u8, 0x7F0000, m16, 128.0)
                chain += f * xv
        acc += db * (chain - 64.0 * xsum)
    return tl.sum(acc, axis=0)


@triton.jit
def _gemv_tile(w32, row_w, row_b, in_r, x_row, t0, magic, kv_ptr, grid_ptr, sign_ptr, QTYPE: tl.constexpr, K,
               NUM_KB: tl.constexpr, NUM_T: tl.constexpr, T_PER_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr):
    """One row for the other types (Q8_0, Q6_K, IQ4_XS: 6.6-8.5 bits a value, less work per byte): the decoded
    tile ``_word_tile`` times x into an elementwise ``[BLOCK_R, 256]`` accumulator, reduced once at the end."""
    acc = tl.zeros([BLOCK_R, 256], dtype=tl.float32)
    for s in range(T_PER_SPLIT):
        t = t0 + s
        live = t < NUM_T
        ks = 256 * t + tl.arange(0, 256)[None, :]
        w = _word_tile(w32, row_w, row_b, in_r & live, t, magic, kv_ptr, grid_ptr, sign_ptr, QTYPE, NUM_KB, BLOCK_R)
        acc += w * tl.load(x_row + ks, mask=(ks < K) & live, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=1)


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, part_ptr, count_ptr, grid_ptr, kv_ptr, sign_ptr, M, R,
                         stride_xm, stride_om, magic, EXPERTS: tl.constexpr, QTYPE: tl.constexpr, K: tl.constexpr,
                         ROW_BYTES: tl.constexpr, NUM_KB: tl.constexpr, NUM_T: tl.constexpr,
                         T_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, M_PAD: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         PDL: tl.constexpr):
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
    w32 = w_ptr.to(tl.pointer_type(tl.int32))  # the tensor's start: 16-byte aligned
    rows = rows_w.to(tl.int64)  # rows of the byte matrix
    if EXPERTS:  # stacked [E, R, ROW_BYTES]: x row pid_m (BLOCK_M = 1) against its expert's matrix
        rows += tl.load(ids_ptr + pid_m).to(tl.int64) * R
    row_w = rows[:, None] * (ROW_BYTES // 4)  # [BLOCK_R, 1] row starts in words, where rows are whole words
    row_b = rows[:, None] * ROW_BYTES  # in bytes (Q8_0, Q6_K, IQ3_XXS: words read at byte offsets)
    t0 = pid_k * T_PER_SPLIT
    if BLOCK_M == 1:  # decode: nothing padded, no dot
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        if QTYPE == 12 or QTYPE == 13:
            y = _gemv_k(w32, row_w, in_r[:, None], x_row, t0, magic, QTYPE, NUM_T, T_PER_SPLIT, BLOCK_R)
        elif QTYPE == 18:
            y = _gemv_iq3_xxs(w32, rows[None, :] * ROW_BYTES, in_r[None, :], x_row, t0, magic, grid_ptr, sign_ptr,
                              NUM_T, T_PER_SPLIT, BLOCK_R)
        else:
            y = _gemv_tile(w32, row_w, row_b, in_r[:, None], x_row, t0, magic, kv_ptr, grid_ptr, sign_ptr, QTYPE, K,
                           NUM_KB, NUM_T, T_PER_SPLIT, BLOCK_R)
        acc = y[None, :]
    else:  # verify: the tile decoded once into registers, then one tensor-core dot with every x row
        # W is the dot's left operand (its rows the MMA's M): at BLOCK_R = 64 and 4 warps Hopper's wgmma takes it
        # from registers, where the decoded tile already is; x, the small operand, is the one staged in shared memory
        x_rows = x_ptr + rows_x.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        acc_t = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
        for i in range(T_PER_SPLIT):
            t = t0 + i
            live = t < NUM_T
            w = _word_tile(w32, row_w, row_b, in_r[:, None] & live, t, magic, kv_ptr, grid_ptr, sign_ptr, QTYPE,
                           NUM_KB, BLOCK_R)
            ks = 256 * t + tl.arange(0, 256)
            a = tl.load(x_rows + ks[None, :], mask=in_m[:, None] & (ks < K)[None, :] & live, other=0.0)
            acc_t = tl.dot(w.to(x_ptr.dtype.element_ty), tl.trans(a), acc_t, input_precision=DOT_PRECISION)
        acc = tl.trans(acc_t)
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
    if config is not None:
        cfg = config
    elif experts:  # one program column a pair: the split counts them all
        cfg = default_config(1, r, k, qw.qtype)
        cfg = replace(cfg, split_k=_split(triton.cdiv(r, cfg.block_r) * rows, triton.cdiv(k, TILE), 1024))
    else:
        cfg = default_config(rows, r, k, qw.qtype)
    elems = block_shape(qw.qtype)[0]
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
        tables.iq4_kvalues, tables.iq3xxs_sign_words, rows, r, x.stride(0), out.stride(0), MAGIC, EXPERTS=experts,
        QTYPE=int(qw.qtype), K=k, ROW_BYTES=qw.data.shape[-1], NUM_KB=k // elems, NUM_T=num_t,
        T_PER_SPLIT=t_per_split, SPLIT_K=split, M_PAD=m_tiles * block_m, BLOCK_M=block_m, BLOCK_R=cfg.block_r,
        DOT_PRECISION=precision, PDL=pdl_enabled(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(x.device))
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
    one-row paths, no dot), its expert's bytes found from the id on the device (no host sync; an id
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
