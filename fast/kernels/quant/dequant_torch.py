"""Dequantization in vectorised torch, the twin of the Triton decoders (``dequant_triton.py``) and equal BIT FOR BIT
in fp32 to gguf-py's numpy ``gguf.quants.dequantize`` (the reference's loader): every formula below keeps
gguf-py's operations and their order (``d * sc`` first, then ``(d sc) q - dmin m``; ``(d (1/2 + s) ) / 2`` then
``* grid``), so each value is the same single IEEE rounding chain.

Notation per block: ``f16(..)`` a little-endian IEEE half read as fp32 (exact), ``u8[i]`` byte i of the block,
``i8`` the byte as a signed int, ``e`` the value's index in the block. Every type's values are
``[n_blocks, block_elems]``, row-major as the matrix's columns run.

**Q8_0** (32 values, 34 bytes)::

    bytes  0..1   d  (f16)
    bytes  2..33  q[e] (int8)                     y[e] = q[e] * d

**Q4_K** (256 values in 8 sub-blocks of 32, 144 bytes)::

    bytes  0..1  d (f16)     2..3  dmin (f16)
    bytes  4..15 scales: 8 six-bit scales sc[j] and mins m[j] (get_scale_min_k4)
                   j < 4:  sc[j] = u8[4+j] & 63,                      m[j] = u8[8+j] & 63
                   j >= 4: sc[j] = (u8[8+j] & 15) | (u8[j] >> 6) << 4, m[j] = (u8[8+j] >> 4) | (u8[4+j] >> 6) << 4
    bytes 16..143 qs: sub-blocks 2i and 2i+1 share bytes qs[32i .. 32i+31]: low nibbles, then high nibbles
                                                  y[e] = (d sc[j]) * q[e] - (dmin m[j]),   j = e / 32

**Q5_K** (256 values, 176 bytes): Q4_K's fields, plus a fifth bit::

    bytes 0..15 as Q4_K;  bytes 16..47 qh;  bytes 48..175 qs (as Q4_K's)
    q[e] = nibble(e) | ((qh[e % 32] >> j) & 1) << 4,   j = e / 32
                                                  y[e] = (d sc[j]) * q[e] - (dmin m[j])

**Q6_K** (256 values in 16 sub-blocks of 16, 210 bytes)::

    bytes   0..127 ql;  128..191 qh;  192..207 scales sc[16] (int8);  208..209 d (f16)
    e = 128 h + 32 s + l  (half h, quarter s, l < 32):
        q[e] = ((ql[64 h + 32 (s % 2) + l] >> 4 (s / 2)) & 15 | ((qh[32 h + l] >> 2 s) & 3) << 4) - 32
                                                  y[e] = (d sc[e / 16]) * q[e]

**IQ4_XS** (256 values in 8 sub-blocks of 32, 136 bytes)::

    bytes 0..1 d (f16);  2..3 scales_h (u16);  4..7 scales_l;  8..135 qs
    ls[j] = ((scales_l[j / 2] >> 4 (j % 2)) & 15 | ((scales_h >> 2 j) & 3) << 4) - 32
    sub-block j's 32 values: the low nibbles of qs[16 j .. 16 j + 15], then their high nibbles
                                                  y[e] = (d ls[j]) * kvalues[nibble(e)]

**IQ3_XXS** (256 values in 8 sub-blocks of 32, 98 bytes)::

    bytes 0..1 d (f16);  2..65 qs: 64 grid indices;  66..97 s[8] (u32, one a sub-block)
    db[j] = (d * (1/2 + (s[j] >> 28))) * 1/2
    sub-block j, value p < 32: magnitude grid[qs[8 j + p / 4]][p % 4];
    sign: bit p % 8 of ksigns[(s[j] >> 7 (p / 8)) & 127] set means minus
                                                  y[e] = (db[j] * magnitude) * (+-1)

F32, F16 and BF16 need no decoding: their bytes viewed as the dtype, widened to fp32 (exact).
Tables: ``tables.py`` (gguf-py's own).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .layout import FLOAT_TYPES, Q, QuantWeight, block_shape
from .tables import iq_tables


def _f16(fields: Tensor) -> Tensor:
    """``[n, 2]`` bytes as one little-endian half each, in fp32: ``[n, 1]``."""
    return fields.contiguous().view(torch.float16).float()


def _u(fields: Tensor) -> Tensor:
    """``[n, k]`` bytes as int32 (so shifts and masks never see a uint8 overflow or a sign)."""
    return fields.to(torch.int32)


@functools.lru_cache(maxsize=None)
def _shifts(values: tuple[int, ...], device: torch.device, shape: tuple[int, ...]) -> Tensor:
    """A constant shift vector on ``device``, made once (so no host-to-device copy runs inside a graph capture
    after the warm-up call)."""
    return torch.tensor(values, dtype=torch.int32, device=device).reshape(shape)


def _q8_0(b: Tensor) -> Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def _scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 scale bytes as 8 six-bit scales and 8 six-bit mins, int32 ``[n, 8]`` each (gguf-py's
    ``Q4_K.get_scale_min``: rows d, m, m_d of 4 bytes)."""
    s = _u(scales).reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_nibbles(qs: Tensor) -> Tensor:
    """Q4_K/Q5_K's 128 qs bytes as 256 nibbles in value order: int32 ``[n, 8, 32]``."""
    n = qs.shape[0]
    q = _u(qs).reshape(n, 4, 1, 32) >> _shifts((0, 4), qs.device, (1, 1, 2, 1))
    return (q & 0x0F).reshape(n, 8, 32)


def _q4_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    q = _k_nibbles(b[:, 16:]).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    qh = (_u(b[:, 16:48]).reshape(n, 1, 1, 32) >> _shifts(tuple(range(8)), b.device, (1, 1, 8, 1))) & 1
    q = (_k_nibbles(b[:, 48:]) | (qh.reshape(n, 8, 32) << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    ql = (_u(b[:, :128]).reshape(n, 2, 1, 64) >> _shifts((0, 4), b.device, (1, 1, 2, 1))) & 0x0F
    qh = (_u(b[:, 128:192]).reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), b.device, (1, 1, 4, 1))) & 0x03
    q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


def _iq4_xs(b: Tensor) -> Tensor:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    scales_h = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [n, 1]
    scales_l = (_u(b[:, 4:8]).reshape(n, 4, 1) >> _shifts((0, 4), b.device, (1, 1, 2))).reshape(n, 8) & 0x0F
    scales_h = (scales_h >> _shifts(tuple(range(0, 16, 2)), b.device, (1, 8))) & 0x03
    ls = (scales_l | (scales_h << 4)) - 32
    dl = (d * ls.float()).reshape(n, 8, 1)
    q = (_u(b[:, 8:]).reshape(n, 8, 1, 16) >> _shifts((0, 4), b.device, (1, 1, 2, 1))).reshape(n, 8, 32) & 0x0F
    kvalues = iq_tables(b.device).iq4_kvalues
    return (dl * kvalues[q.long()]).reshape(n, 256)


def _iq3_xxs(b: Tensor) -> Tensor:
    n = b.shape[0]
    tables = iq_tables(b.device)
    d = _f16(b[:, 0:2])
    s = b[:, 66:98].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [n, 8] as unsigned
    db = (d * (0.5 + (s >> 28).float()) * 0.5).reshape(n, 8, 1, 1)
    idx = (s.reshape(n, 8, 1) >> _shifts((0, 7, 14, 21), b.device, (1, 1, 4))) & 0x7F
    sign_bytes = _u(tables.ksigns[idx])  # [n, 8, 4]
    bits = (sign_bytes.reshape(n, 8, 4, 1) >> _shifts(tuple(range(8)), b.device, (1, 1, 1, 8))) & 1
    signs = torch.where(bits == 0, 1.0, -1.0)
    grid = tables.iq3xxs_grid.reshape(256, 4)[b[:, 2:66].long()].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


DECODERS = {Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_XS: _iq4_xs, Q.IQ3_XXS: _iq3_xxs}


def dequantize_torch(qw: QuantWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """``qw``'s values, ``qw.shape`` (``[rows, cols]`` or ``[E, rows, cols]``) in ``dtype``: decoded in fp32
    (module docstring), then rounded once to ``dtype``."""
    if qw.qtype in FLOAT_TYPES:
        return qw.data.view(FLOAT_TYPES[qw.qtype]).reshape(qw.shape).to(dtype)
    _, nbytes = block_shape(qw.qtype)
    values = DECODERS[qw.qtype](qw.data.reshape(-1, nbytes))
    return values.reshape(qw.shape).to(dtype)
