"""The Triton decoders of the GGUF block types and the dequantize kernel built on them (large prefill chunks: the
weight dequantized to bf16 once, then one dense matmul), twin of ``dequant_torch.dequantize_torch``.

One decoder, :func:`_word_tile`, serves this kernel and the fused matmul's verify path (``quant_matmul.py``; its
one-row paths read the same words with the same helpers, in their own order): given BLOCK_R rows and a tile
index t, it returns the fp32 values ``[BLOCK_R, 256]`` of the rows' values ``256 t .. 256 t + 255`` in natural order
(one 256-value block of the K and IQ types; eight 32-value Q8_0 blocks, those past the row's end masked to 0).

How a block is read (the "word decoders" section below): its payload as int32 words, 16-byte vectors where
blocks are 4-byte aligned (Q4_K, Q5_K, IQ4_XS: 144, 176, 136 bytes), aligned words funnel-shifted where they are
only 2-byte aligned (Q8_0, Q6_K, IQ3_XXS: 34, 210, 98 bytes); each word's four bytes become four values on an
innermost axis that a thread holds whole (``tl.join``), so the tile reshapes to natural order with no data
movement; and a bit field becomes a float by the exponent trick of ``_field`` (no conversion instruction). The
formulas are ``dequant_torch.py``'s (its docstring lays out each block), with the same rounded operations in the
same order (``(d sc) q - dmin m`` as a product then a difference; ``(d (1/2 + s)) / 2`` times the magnitude),
so in fp32 the values are bit for bit the twin's (and gguf-py's). IQ3_XXS's signs come from
``tables.iq3xxs_sign_words`` (the sign byte ``ksigns[i]`` applied to four magnitudes at once, in offset binary);
IQ4_XS's levels are gathered from the 64-byte table.

Exactness on the GPU: this kernel launches with ``enable_fp_fusion=False``, because ptxas would otherwise contract
``(d sc) q - dmin m`` into one fused multiply-add, one rounding fewer than numpy's (a different last bit). The
interpreter (CPU tests) evaluates each operation in numpy, so the question does not arise there.

Grid of the dequantize kernel: ``(cdiv(rows, BLOCK_R), cdiv(cols, 256))``, one 256-value tile of BLOCK_R rows a
program; stacked experts ``[E, rows, ...]`` are ``E rows`` rows. Bound: the output's writes (2 bytes a value in
bf16 against 0.4-1.1 bytes read)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.triton_compat import tl, triton
from .layout import QUANT_TYPES, Q, QuantWeight, block_shape
from .tables import iq_tables

TILE = 256  # values of one decoded tile along a row (module docstring)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- word decoders: the quantized payload read as int32 words ------------------------------------------------
#
# Byte loads and I2F are what made the first fused kernel slow (issue 35): a load and a conversion a value, and
# I2F runs at 1/8 of the FP32 rate on Hopper. A bit field becomes a float without a conversion instruction:
# OR'd into the mantissa of 2^(23-P) (P the field's lowest bit, P + width <= 23), the word read as fp32 is
# 2^(23-P) + field exactly, and one subtraction leaves the field (``_field``: one LOP3 and one FADD a value; the
# magic exponent sits in a register, ``magic`` a runtime argument, because LOP3 takes one immediate only).

MAGIC = 0x4B000000  # the fp32 bits of 2^23, passed to the kernels as ``magic``
_SIGN_BYTES = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: XOR flips each byte's top bit (int8 -> q + 128)


@triton.jit
def _field(word, mask, magic_p, base):
    """``(word & mask) >> P`` as fp32, exact, minus ``base - 2^(23-P)`` (so base = 2^(23-P) + c gives field - c):
    ``magic_p`` = ``magic - (P << 23)``, the bits of 2^(23-P); ``mask`` within bits P..22."""
    return ((word & mask) | magic_p).to(tl.float32, bitcast=True) - base


@triton.jit
def _f16_lo(word):
    return (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(word):
    return (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_at(w32, a, mask):
    """The 4 bytes at byte offset ``a`` (int64, even) of the int32 view ``w32``, little-endian, as an int32: the
    aligned word holding the first, funnel-shifted with the next when ``a`` is 2 mod 4 (read only then)."""
    lo = tl.load(w32 + (a >> 2), mask=mask, other=0)
    hi = tl.load(w32 + (a >> 2) + 1, mask=mask & ((a & 2) != 0), other=0)
    return (((hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)) >> ((a & 2) * 8)).to(tl.int32)


@triton.jit
def _f16_at(w32, a, mask):
    """The little-endian half at byte offset ``a`` (even) as fp32 (exact)."""
    return _f16_lo(tl.load(w32 + (a >> 2), mask=mask, other=0) >> ((a & 2) * 8).to(tl.int32))


@triton.jit
def _join4(v0, v1, v2, v3):
    """``[..., 2, 2]`` with v_b at ``[..., b // 2, b % 2]`` (row-major: index b of a flattened innermost 4), two new
    innermost axes held by the thread that holds the operands."""
    return tl.join(tl.join(v0, v2), tl.join(v1, v3))


@triton.jit
def _byte_fields(word, magic, base):
    """The four bytes of ``word`` as fp32, each minus ``base``: ``[..., 2, 2]``, byte b at index b (``_join4``).
    Bytes 2 and 3 are read shifted down to bits 8..15 (a field must stay below bit 23, the exponent's)."""
    m8 = magic - (8 << 23)
    return _join4(_field(word, 0xFF, magic, 8388608.0 + base), _field(word, 0xFF00, m8, 32768.0 + base),
                  _field(word >> 8, 0xFF00, m8, 32768.0 + base), _field(word >> 16, 0xFF00, m8, 32768.0 + base))


@triton.jit
def _k_scale_words(H0, H1, H2, H3, i):
    """Q4_K/Q5_K's scales and mins of sub-blocks 4 (i // 2) .. + 3 as bytes of two int32s (sc, m), 6 bits a byte
    (``dequant_torch._scale_min_k4``): i < 2 reads them whole from bytes 4..11, i >= 2 assembles them from the low and
    high nibbles of bytes 12..15 and the top bits of bytes 4..11."""
    sc = tl.where(i < 2, H1, (H3 & 0x0F0F0F0F) | ((H1 >> 2) & 0x30303030))
    mn = tl.where(i < 2, H2, ((H3 >> 4) & 0x0F0F0F0F) | ((H2 >> 2) & 0x30303030))
    return sc, mn


@triton.jit
def _word_tile(w32, row_w, row_b, in_r, t, magic, kv_ptr, grid_ptr, sign_ptr, QTYPE: tl.constexpr,
               NUM_KB: tl.constexpr, BLOCK_R: tl.constexpr):
    """Values ``256 t .. 256 t + 255`` of BLOCK_R rows, fp32 ``[BLOCK_R, 256]`` in natural order, each the twin's
    fp32 value bit for bit (the same operations: ``(d sc) q - dmin m`` as a product then a difference, never a
    fused multiply-add; the kernels that need the bits launch with fp fusion off). ``row_w [BLOCK_R, 1]``: the
    rows' starts in words (the 4-byte aligned types), ``row_b``: in bytes (the others); ``in_r [BLOCK_R, 1]``.

    Each type's tile is built as ``[BLOCK_R, ..., 2, 2]``: the outer axes index words (one load a word; loaded
    twice, on a broadcast axis, where one word holds two sub-blocks' nibbles), the innermost two the word's 4
    bytes (``_byte_fields``), in natural order, so the reshape to ``[BLOCK_R, 256]`` moves no data."""
    if QTYPE == 8:  # Q8_0: 8 blocks of 34 bytes [BR, 8 blocks, 8 words, 4 bytes], y = q d
        kb = tl.arange(0, 8)[None, :, None]
        a = row_b[:, :, None] + 34 * (8 * t + kb)
        mask = in_r[:, :, None] & (8 * t + kb < NUM_KB)
        d = _f16_at(w32, a, mask)[:, :, :, None, None]
        words = _word_at(w32, a + 2 + 4 * tl.arange(0, 8)[None, None, :], mask) ^ _SIGN_BYTES  # int8 -> q + 128
        v = _byte_fields(words, magic, 128.0) * d
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K [BR, 4 pairs i, 2 halves h, 8 words, 4 bytes]: j = 2 i + h
        BLOCK_W: tl.constexpr = 36 if QTYPE == 12 else 44
        i = tl.arange(0, 4)[None, :, None, None]
        h = tl.arange(0, 2)[None, None, :, None]
        w = tl.arange(0, 8)[None, None, None, :]
        blk = w32 + row_w[:, :, None, None] + BLOCK_W * t
        mask = in_r[:, :, None, None]
        H0 = tl.load(blk, mask=mask, other=0)
        sc, mn = _k_scale_words(H0, tl.load(blk + 1, mask=mask, other=0), tl.load(blk + 2, mask=mask, other=0),
                                tl.load(blk + 3, mask=mask, other=0), i)
        sh = 16 * (i % 2) + 8 * h  # byte j % 4
        S = _f16_lo(H0) * _field(sc >> sh, 0x3F, magic, 8388608.0)  # [BR, 4, 2, 1]: d sc[j]
        M = _f16_hi(H0) * _field(mn >> sh, 0x3F, magic, 8388608.0)  # dmin m[j]
        q = (tl.load(blk + (BLOCK_W - 32) + 8 * i + w + 0 * h, mask=mask, other=0) >> (4 * h)) & 0x0F0F0F0F
        if QTYPE == 13:  # the fifth bit: bit j of qh byte p = 4 w + b
            qh = tl.load(blk + 4 + w, mask=mask, other=0)
            q = q | (((qh >> (2 * i + h)) & 0x01010101) << 4)
        v = _byte_fields(q, magic, 0.0) * S[:, :, :, :, None, None] - M[:, :, :, :, None, None]
    elif QTYPE == 14:  # Q6_K [BR, 2 halves h, 4 quarters s, 8 words, 4 bytes]: y = (d sc[e / 16]) (q - 32)
        h = tl.arange(0, 2)[None, :, None, None]
        s = tl.arange(0, 4)[None, None, :, None]
        w = tl.arange(0, 8)[None, None, None, :]
        a = row_b[:, :, None, None] + 210 * t
        mask = in_r[:, :, None, None]
        ql = _word_at(w32, a + 4 * (16 * h + 8 * (s % 2) + w), mask)
        qh = _word_at(w32, a + 128 + 4 * (8 * h + w), mask)
        q = ((ql >> (4 * (s // 2))) & 0x0F0F0F0F) | (((qh >> (2 * s)) & 0x03030303) << 4)
        sa = a + 192 + 8 * h + 2 * s + w // 4  # the int8 scale of the word's 16 values
        sc_word = tl.load(w32 + (sa >> 2), mask=mask, other=0) >> ((sa & 3) * 8).to(tl.int32)
        D = _f16_at(w32, a + 208, mask) * _field(sc_word ^ 0x80, 0xFF, magic, 8388608.0 + 128.0)
        v = _byte_fields(q, magic, 32.0) * D[:, :, :, :, None, None]
    elif QTYPE == 23:  # IQ4_XS [BR, 8 sub-blocks j, 2 halves, 4 words, 4 bytes]: y = (d ls[j]) kvalues[q]
        j = tl.arange(0, 8)[None, :, None, None]
        hf = tl.arange(0, 2)[None, None, :, None]
        blk = w32 + row_w[:, :, None, None] + 34 * t
        mask = in_r[:, :, None, None]
        H0 = tl.load(blk, mask=mask, other=0)
        ls = (((tl.load(blk + 1, mask=mask, other=0) >> (4 * j)) & 15) | (((H0 >> (16 + 2 * j)) & 3) << 4)) - 32
        dl = _f16_lo(H0) * ls.to(tl.float32)
        q = tl.load(blk + 2 + 4 * j + tl.arange(0, 4)[None, None, None, :] + 0 * hf, mask=mask, other=0) >> (4 * hf)
        v = _join4(tl.load(kv_ptr + (q & 15)), tl.load(kv_ptr + ((q >> 8) & 15)), tl.load(kv_ptr + ((q >> 16) & 15)),
                   tl.load(kv_ptr + ((q >> 24) & 15))) * dl[:, :, :, :, None, None]
    else:  # IQ3_XXS (18) [BR, 8 sub-blocks j, 8 grid words k, 4 magnitudes]: y = ((d (1/2 + s[j] >> 28)) / 2) (+-g)
        tl.static_assert(QTYPE == 18, "unsupported GGML type")
        j = tl.arange(0, 8)[None, :, None]
        k = tl.arange(0, 8)[None, None, :]
        a = row_b[:, :, None] + 98 * t
        mask = in_r[:, :, None]
        sw = _word_at(w32, a + 66 + 4 * j, mask)  # [BR, 8, 1]
        db = _f16_at(w32, a, mask) * (0.5 + ((sw >> 28) & 15).to(tl.float32)) * 0.5
        qw = _word_at(w32, a + 2 + 8 * j + 4 * tl.arange(0, 2)[None, None, :], mask)  # [BR, 8, 2]: 4 indices each
        idx = tl.reshape(_join4(qw & 255, (qw >> 8) & 255, (qw >> 16) & 255, (qw >> 24) & 255), (BLOCK_R, 8, 8))
        signs = sign_ptr + 4 * ((sw >> (7 * (k // 2))) & 127) + 2 * (k % 2)
        u = ((tl.load(grid_ptr + idx) ^ tl.load(signs)) + tl.load(signs + 1)) & 0x7F7F7F7F  # 64 +- magnitude
        v = _byte_fields(u, magic, 64.0) * db[:, :, :, None, None]
    return tl.reshape(v, (BLOCK_R, 256))


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, grid_ptr, kv_ptr, sign_ptr, ROWS, magic, QTYPE: tl.constexpr, COLS: tl.constexpr,
                    ROW_BYTES: tl.constexpr, NUM_KB: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_r = tl.program_id(0)
    t = tl.program_id(1)  # the 256-value tile along the row
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = (rows < ROWS)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    v = _word_tile(w_ptr.to(tl.pointer_type(tl.int32)), r64 * (ROW_BYTES // 4), r64 * ROW_BYTES, in_r, t, magic,
                   kv_ptr, grid_ptr, sign_ptr, QTYPE, NUM_KB, BLOCK_R)
    cols = 256 * t + tl.arange(0, 256)[None, :]
    tl.store(out_ptr + r64 * COLS + cols, v.to(out_ptr.dtype.element_ty), mask=in_r & (cols < COLS))


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
    elems = block_shape(qw.qtype)[0]
    rows = qw.data.numel() // qw.data.shape[-1]  # stacked experts: E rows rows
    if rows == 0 or qw.cols == 0:
        return out
    tables = iq_tables(qw.device)
    _dequant_kernel[(triton.cdiv(rows, block_r), triton.cdiv(qw.cols, TILE))](
        qw.data, out, tables.iq3xxs_grid_packed, tables.iq4_kvalues, tables.iq3xxs_sign_words, rows, MAGIC,
        QTYPE=int(qw.qtype), COLS=qw.cols, ROW_BYTES=qw.data.shape[-1], NUM_KB=qw.cols // elems, BLOCK_R=block_r,
        num_warps=4 if block_r <= 16 else 8, enable_fp_fusion=False)
    return out
