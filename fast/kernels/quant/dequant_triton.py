"""The Triton decoders of the GGUF block types and the dequantize kernel built on them (large prefill chunks: the
weight dequantized to bf16 once, then one dense matmul), twin of ``dequant_torch.dequantize_torch``.

One decoder, :func:`_decode_tile`, serves this kernel and the fused matmul (``quant_matmul.py``): given the row
starts of BLOCK_R rows and a tile index t, it returns the fp32 values ``[BLOCK_R, 8, 32]`` of the row's values
``256 t .. 256 t + 255`` (one 256-value block of the K and IQ types; eight 32-value Q8_0 blocks, those past the
row's end masked to 0), as 8 sub-blocks j of 32 values p: the K and IQ types' own sub-blocks (one scale, and
for Q4_K/Q5_K one min, a row and sub-block; Q6_K's 16-value sub-blocks are two to a j). A whole block at a time
keeps the per-row header loads ([BLOCK_R, 8, 1] or [BLOCK_R, 1, 1]: d, dmin, the scales) few against the
values' loads, which run contiguously along p. The formulas are ``dequant_torch.py``'s (its docstring lays out
each block), with the same operations in the same order, so in fp32 the values are bit for bit the twin's (and
gguf-py's).

Exactness on the GPU: the kernel launches with ``enable_fp_fusion=False``, because ptxas would otherwise
contract ``(d sc) q - dmin m`` into one fused multiply-add, one rounding fewer than numpy's (a different last
bit). The interpreter (CPU tests) evaluates each operation in numpy, so the question does not arise there.

fp16 block fields are read as two bytes and assembled (no 2-byte alignment needed: Q8_0's blocks are 34 bytes);
IQ3_XXS's 32-bit word is read as its low 28 bits (the seven-bit sign indices) and its top nibble (the scale),
so no unsigned 32-bit shift is needed; its sign byte is computed, ``ksigns[i] = i | parity(i) << 7``, and its
magnitudes come from the packed grid (``tables.py``: gguf-py's grid, four bytes an int32). IQ4_XS's 16 levels
are gathered from a 64-byte table.

Grid of the dequantize kernel: ``(cdiv(rows, BLOCK_R), cdiv(cols, 256))``, one 256-value tile of BLOCK_R rows a
program; stacked experts ``[E, rows, ...]`` are ``E rows`` rows. Bound: the output's writes (2 bytes a value in
bf16 against 0.4-1.1 bytes read).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.triton_compat import tl, triton
from .layout import QUANT_TYPES, Q, QuantWeight, block_shape
from .tables import iq_tables

TILE = 256  # values of one decoded tile along a row (module docstring)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian half at ``ptr`` (two byte loads), as fp32 (exact)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_tile(row, in_r, t, QTYPE: tl.constexpr, NUM_KB: tl.constexpr, BLOCK_BYTES: tl.constexpr, grid_ptr,
                 kv_ptr):
    """Values ``256 t + 32 j + p`` of the rows at ``row`` (``[BLOCK_R, 1, 1]`` uint8 pointers to the row starts),
    fp32 ``[BLOCK_R, 8, 32]`` (j, p); rows where ``in_r`` (``[BLOCK_R, 1, 1]``) is false, and Q8_0 blocks past
    NUM_KB, read zeros and give 0. QTYPE is the GGML type number (8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, 23 IQ4_XS,
    18 IQ3_XXS)."""
    j = tl.arange(0, 8)[None, :, None]
    p = tl.arange(0, 32)[None, None, :]
    if QTYPE == 8:  # Q8_0: eight blocks, j-th at block 8 t + j: y = q * d
        kb = 8 * t + j
        mask = in_r & (kb < NUM_KB)
        blk = row + kb * BLOCK_BYTES
        d = _f16(blk, mask)
        q = tl.load(blk + 2 + p, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        v = q * d
    else:
        blk = row + t * BLOCK_BYTES
        mask = in_r
        if QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: y = (d sc[j]) q - (dmin m[j])
            d = _f16(blk, mask)
            dmin = _f16(blk + 2, mask)
            b_lo = _byte(blk + 4 + j, mask)  # j < 4: scale j, j >= 4: the mins' bytes (their top bits)
            b_mid = _byte(blk + 8 + j, mask)  # j < 4: min j, j >= 4: bytes 12..15 (low nibbles: scale, high: min)
            b_top = _byte(blk + j, mask)  # j >= 4: bytes 4..7 (their top bits: the scale's high two)
            sc = tl.where(j < 4, b_lo & 63, (b_mid & 15) | ((b_top >> 6) << 4))
            mn = tl.where(j < 4, b_mid & 63, (b_mid >> 4) | ((b_lo >> 6) << 4))
            dsub = d * sc.to(tl.float32)
            dm = dmin * mn.to(tl.float32)
            if QTYPE == 12:
                q = (_byte(blk + 16 + 32 * (j // 2) + p, mask) >> (4 * (j % 2))) & 15
            else:
                low = (_byte(blk + 48 + 32 * (j // 2) + p, mask) >> (4 * (j % 2))) & 15
                q = low | (((_byte(blk + 16 + p, mask) >> j) & 1) << 4)
            v = dsub * q.to(tl.float32) - dm
        elif QTYPE == 14:  # Q6_K: y = (d sc[e / 16]) q; j = 4 h + s (half h, quarter s)
            low = (_byte(blk + 64 * (j // 4) + 32 * (j % 2) + p, mask) >> (4 * ((j % 4) // 2))) & 15
            high = (_byte(blk + 128 + 32 * (j // 4) + p, mask) >> (2 * (j % 4))) & 3
            q = (low | (high << 4)) - 32
            sc = tl.load(blk + 192 + 2 * j + p // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            d = _f16(blk + 208, mask)
            v = (d * sc) * q.to(tl.float32)
        elif QTYPE == 23:  # IQ4_XS: y = (d ls[j]) kvalues[q]
            d = _f16(blk, mask)
            scales_h = _byte(blk + 2, mask) | (_byte(blk + 3, mask) << 8)
            scales_l = (_byte(blk + 4 + j // 2, mask) >> (4 * (j % 2))) & 15
            ls = (scales_l | (((scales_h >> (2 * j)) & 3) << 4)) - 32
            dl = d * ls.to(tl.float32)
            q = (_byte(blk + 8 + 16 * j + p % 16, mask) >> (4 * (p // 16))) & 15
            v = dl * tl.load(kv_ptr + q)
        else:  # IQ3_XXS (18): y = ((d (1/2 + s[j] >> 28)) / 2) grid[..] * sign
            tl.static_assert(QTYPE == 18, "unsupported GGML type")
            d = _f16(blk, mask)
            word = blk + 66 + 4 * j
            top = _byte(word + 3, mask)
            low28 = _byte(word, mask) | (_byte(word + 1, mask) << 8) | (_byte(word + 2, mask) << 16) | ((top & 15) << 24)
            db = d * (0.5 + (top >> 4).to(tl.float32)) * 0.5
            g = _byte(blk + 2 + 8 * j + p // 4, mask)
            magnitude = ((tl.load(grid_ptr + g) >> (8 * (p % 4))) & 255).to(tl.float32)
            idx = (low28 >> (7 * (p // 8))) & 127  # the 7 stored sign bits of p's group of 8
            parity = idx ^ (idx >> 4)
            parity = parity ^ (parity >> 2)
            parity = (parity ^ (parity >> 1)) & 1  # ksigns' bit 7: an even count of minus signs
            minus = tl.where(p % 8 == 7, parity, (idx >> (p % 8)) & 1)
            v = db * magnitude
            v = tl.where(minus != 0, -v, v)
    return v


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, grid_ptr, kv_ptr, ROWS, QTYPE: tl.constexpr, COLS: tl.constexpr,
                    ROW_BYTES: tl.constexpr, BLOCK_BYTES: tl.constexpr, NUM_KB: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_r = tl.program_id(0)
    t = tl.program_id(1)  # the 256-value tile along the row
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = (rows < ROWS)[:, None, None]
    row = w_ptr + rows.to(tl.int64)[:, None, None] * ROW_BYTES
    v = _decode_tile(row, in_r, t, QTYPE, NUM_KB, BLOCK_BYTES, grid_ptr, kv_ptr)
    cols = 256 * t + 32 * tl.arange(0, 8)[None, :, None] + tl.arange(0, 32)[None, None, :]
    out = out_ptr + rows.to(tl.int64)[:, None, None] * COLS + cols
    tl.store(out, v.to(out_ptr.dtype.element_ty), mask=in_r & (cols < COLS))


def dequantize_triton(qw: QuantWeight, dtype: torch.dtype = torch.float32, block_r: int = 16,
                      out: Tensor | None = None) -> Tensor:
    """``dequantize_torch``'s contract by one kernel: ``qw``'s values in ``dtype`` (fp32, bf16 or fp16), shape
    ``qw.shape``; or written into ``out`` (contiguous, that shape and dtype)."""
    if qw.qtype not in QUANT_TYPES:
        raise ValueError(f"dequantize_triton: {Q(qw.qtype).name} is not a block type "
                         f"({', '.join(t.name for t in QUANT_TYPES)})")
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dequantize_triton: dtype {dtype}, expected one of {OUT_DTYPES}")
    if out is None:
        out = torch.empty(qw.shape, dtype=dtype, device=qw.device)
    elif tuple(out.shape) != qw.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out {list(out.shape)} {out.dtype}: expected contiguous {list(qw.shape)} {dtype}")
    elems, nbytes = block_shape(qw.qtype)
    rows = qw.data.numel() // qw.data.shape[-1]  # stacked experts: E rows rows
    if rows == 0 or qw.cols == 0:
        return out
    tables = iq_tables(qw.device)
    _dequant_kernel[(triton.cdiv(rows, block_r), triton.cdiv(qw.cols, TILE))](
        qw.data, out, tables.iq3xxs_grid_packed, tables.iq4_kvalues, rows, QTYPE=int(qw.qtype), COLS=qw.cols,
        ROW_BYTES=qw.data.shape[-1], BLOCK_BYTES=nbytes, NUM_KB=qw.cols // elems, BLOCK_R=block_r,
        num_warps=4 if block_r <= 16 else 8, enable_fp_fusion=False)
    return out
