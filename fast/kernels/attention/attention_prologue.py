"""The elementwise prologue and epilogue of gated full attention, each kernel beside its torch twin
(:func:`qk_norm_rope_torch`, :func:`output_gate_torch`; reference/model/attention.py's
``GatedAttention.forward``: per-head RMSNorm, partial NeoX RoPE, the sigmoid output gate).

Prologue, from the fused projection rows ``qkv [N, H*2D + 2*Hkv*D]`` (per query head ``[query D |
gate D]``, then K, then V), per row n at rotation angles ``cos, sin [N, rd/2]`` and head width D::

    y       = x / sqrt(mean(x^2) + eps) * scale          fp32; scale = 1 + w (q_scale or k_scale)
    y1'     = y1 cos - y2 sin,  y2' = y2 cos + y1 sin     y1 = y[:rd/2], y2 = y[rd/2:rd]; y[rd:] as is
    q[n, h]                        = y' (query head h)    in the model dtype
    key_cache[write_index[n], j]   = y' (K head j)        cast to the model dtype, then the cache dtype
    value_cache[write_index[n], j] = v[n, j]

One program per (row, head) over the H query and Hkv K heads; a K-head program also moves the V head
of the same index. The rotation's partner channel (c + rd/2 or c - rd/2) is a second, cached load of
the same row, normalised with the row's rstd. Padding rows write the trash row (``write_index``
points there), several of them at once: nothing reads it.

Epilogue: ``out[n, h*D + d] = attn[n, h, d] * sigmoid(gate[n, h, d])``, the sigmoid rounded to
the model dtype before the product, as the torch form computes it; ``gate`` is read in place from
the projection (row stride ``H*2D + 2*Hkv*D``, head stride 2D).

The draft's prologue (:func:`draft_qk_norm_rope_triton`, twin of :func:`draft_qk_norm_rope_torch`
and so of reference/model/draft.py's ``qwen3_rms_norm`` + ``apply_rope``) is the same norm and rotation on separate
q ``[N, H, D]`` and k ``[N, Hkv, D]`` (views into the draft's q and k/v projections), with the
weights as stored for scales (Qwen3's ``w * x / rms(x)``), returning both in the model dtype: no gate
columns, no cache write (the block's keys never enter the ring). One program per (row, head) over
the H + Hkv heads.

Bound: launch latency at decode sizes (a few KiB per row). Deterministic, no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from ..common.pdl import launch_options, pdl_enabled
from ..common.triton_compat import tl, triton
from ..dense.rms_norm import rms_norm
from .rope import apply_rope


def qk_norm_rope_torch(qkv: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor, eps: float,
                       num_heads: int, num_kv_heads: int, key_cache: Tensor, value_cache: Tensor,
                       write_index: Tensor) -> Tensor:
    """The attention prologue: ``q = rope(rmsnorm_q(q))``, and ``rope(rmsnorm_k(k))``, v into the caches.

    qkv: ``[N, H*2D + 2*Hkv*D]`` the fused projection (per query head ``[query D | gate D]``, then K,
    then V); q_scale, k_scale: fp32 ``[D]`` (1 + w); cos, sin: fp32 ``[N, rd/2]``; key_cache,
    value_cache: ``[S, Hkv, D]``, row ``write_index[n]`` receives row n's K and V (in the model
    dtype, then the cache's). Returns q ``[N, H, D]`` in qkv's dtype. Norms and rotation in fp32.
    """
    rows, dim = qkv.shape[0], key_cache.shape[-1]
    query_gate, k, v = torch.split(qkv, [2 * num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
    q = query_gate.view(rows, num_heads, 2 * dim)[..., :dim]  # [N, H, D]
    q = apply_rope(rms_norm(q, q_scale, eps, torch.float32), cos, sin).to(qkv.dtype)
    k = apply_rope(rms_norm(k.view(rows, num_kv_heads, dim), k_scale, eps, torch.float32), cos, sin).to(qkv.dtype)
    key_cache.index_copy_(0, write_index, k.to(key_cache.dtype))
    value_cache.index_copy_(0, write_index, v.view(rows, num_kv_heads, dim).to(value_cache.dtype))
    return q


def draft_qk_norm_rope_torch(q: Tensor, k: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor,
                             eps: float) -> tuple[Tensor, Tensor]:
    """``rope(x / rms(x) * scale)`` per head of q ``[N, H, D]`` and k ``[N, Hkv, D]``, in fp32.

    q_scale, k_scale: fp32 ``[D]`` (the draft's Qwen3 norms: the weights as stored); cos, sin: fp32
    ``[N, rd/2]``. Returns (q, k) in the inputs' dtype.
    """
    q_out = apply_rope(rms_norm(q, q_scale, eps, torch.float32), cos, sin).to(q.dtype)
    return q_out, apply_rope(rms_norm(k, k_scale, eps, torch.float32), cos, sin).to(k.dtype)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_scale_ptr, k_scale_ptr, cos_ptr, sin_ptr, write_index_ptr, q_ptr, kc_ptr, vc_ptr,
                         stride_qkv, stride_cos, stride_sin, stride_kc, stride_kh, stride_vc, stride_vh, eps,
                         H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    rot = d < 2 * HALF
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    angle = tl.where(first, d, d - HALF)
    is_q = head < H
    src = qkv_ptr + n * stride_qkv + tl.where(is_q, head * (2 * D), 2 * H * D + (head - H) * D)
    x = tl.load(src + d, mask=in_d, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    scale = tl.where(is_q, tl.load(q_scale_ptr + d, mask=in_d, other=0.0), tl.load(k_scale_ptr + d, mask=in_d,
                                                                                  other=0.0))
    y = (x * rstd) * scale
    xp = tl.load(src + partner, mask=in_d & rot, other=0.0).to(tl.float32)
    scale_p = tl.where(is_q, tl.load(q_scale_ptr + partner, mask=in_d & rot, other=0.0),
                       tl.load(k_scale_ptr + partner, mask=in_d & rot, other=0.0))
    yp = (xp * rstd) * scale_p
    cos = tl.load(cos_ptr + n * stride_cos + angle, mask=rot, other=1.0)
    sin = tl.load(sin_ptr + n * stride_sin + angle, mask=rot, other=0.0)
    out = tl.where(first, y * cos - yp * sin, tl.where(rot, y * cos + yp * sin, y))
    out = out.to(qkv_ptr.dtype.element_ty)  # the model dtype, as the torch form's .to(dtype)
    if is_q:
        tl.store(q_ptr + n * (H * D) + head * D + d, out, mask=in_d)
    else:
        slot = tl.load(write_index_ptr + n).to(tl.int64)
        tl.store(kc_ptr + slot * stride_kc + (head - H) * stride_kh + d, out.to(kc_ptr.dtype.element_ty), mask=in_d)
        v = tl.load(qkv_ptr + n * stride_qkv + 2 * H * D + HKV * D + (head - H) * D + d, mask=in_d, other=0.0)
        tl.store(vc_ptr + slot * stride_vc + (head - H) * stride_vh + d, v.to(vc_ptr.dtype.element_ty), mask=in_d)


def _check_norm_and_rope(q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor, rows: int, head_dim: int) -> int:
    """The q/k norm scales (contiguous fp32 ``[D]``) and the RoPE rows (fp32 ``[rows, rd/2]``, rd <= D) both kernels
    read; returns rd/2."""
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale)):
        if scale.shape != (head_dim,) or scale.dtype != torch.float32 or not scale.is_contiguous():
            raise ValueError(f"{name}: {list(scale.shape)} {scale.dtype}: expected contiguous fp32 [{head_dim}]")
    half = cos.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (rows, half) or t.dtype != torch.float32 or t.stride(-1) != 1 or 2 * half > head_dim:
            raise ValueError(f"{name}: {list(t.shape)} {t.dtype}: expected fp32 [{rows}, rd/2] with rd <= {head_dim}")
    return half


def qk_norm_rope_triton(qkv: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor, eps: float,
                        num_heads: int, num_kv_heads: int, key_cache: Tensor, value_cache: Tensor,
                        write_index: Tensor) -> Tensor:
    """``qk_norm_rope_torch`` by the kernel. qkv ``[N, H*2D + 2*Hkv*D]`` (unit last stride); q_scale,
    k_scale fp32 ``[D]``; cos, sin fp32 ``[N, rd/2]``; caches ``[S, Hkv, D]``; write_index ``[N]``.
    Returns q ``[N, H, D]`` in qkv's dtype; writes the rows' K and V into the caches."""
    rows = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    width = (2 * num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv: {list(qkv.shape)} strides {qkv.stride()}: expected [N, {width}] with unit last stride")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 3 or cache.shape[1:] != (num_kv_heads, head_dim) or cache.stride(2) != 1:
            raise ValueError(f"{name}: {list(cache.shape)} strides {cache.stride()}: expected [S, {num_kv_heads}, "
                             f"{head_dim}] with unit last stride")
    half = _check_norm_and_rope(q_scale, k_scale, cos, sin, rows, head_dim)
    if write_index.shape != (rows,):
        raise ValueError(f"write_index: {list(write_index.shape)}: expected [{rows}]")
    q = torch.empty((rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return q
    block_d = triton.next_power_of_2(head_dim)
    _qk_norm_rope_kernel[(rows, num_heads + num_kv_heads)](
        qkv, q_scale, k_scale, cos, sin, write_index, q, key_cache, value_cache, qkv.stride(0), cos.stride(0),
        sin.stride(0), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        float(eps), H=num_heads, HKV=num_kv_heads, D=head_dim, HALF=half, BLOCK_D=block_d,
        num_warps=max(1, min(4, block_d // 64)))
    return q


@triton.jit
def _norm_rope_head(src, scale_ptr, cos_row, sin_row, dst, eps, D: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """One head: ``rope(x / rms(x) * scale)`` in fp32 from ``src``, stored at ``dst`` in dst's dtype."""
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    rot = d < 2 * HALF
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    angle = tl.where(first, d, d - HALF)
    x = tl.load(src + d, mask=in_d, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd) * tl.load(scale_ptr + d, mask=in_d, other=0.0)
    xp = tl.load(src + partner, mask=in_d & rot, other=0.0).to(tl.float32)
    yp = (xp * rstd) * tl.load(scale_ptr + partner, mask=in_d & rot, other=0.0)
    cos = tl.load(cos_row + angle, mask=rot, other=1.0)
    sin = tl.load(sin_row + angle, mask=rot, other=0.0)
    out = tl.where(first, y * cos - yp * sin, tl.where(rot, y * cos + yp * sin, y))
    tl.store(dst + d, out.to(dst.dtype.element_ty), mask=in_d)


@triton.jit
def _draft_qk_norm_rope_kernel(q_ptr, k_ptr, q_scale_ptr, k_scale_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                               stride_qn, stride_qh, stride_kn, stride_kh, stride_cos, stride_sin, eps,
                               H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                               BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # first, before any load or store: fast/kernels/common/pdl.py's rule
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cos_row, sin_row = cos_ptr + n * stride_cos, sin_ptr + n * stride_sin
    if head < H:
        _norm_rope_head(q_ptr + n * stride_qn + head * stride_qh, q_scale_ptr, cos_row, sin_row,
                        q_out_ptr + (n * H + head) * D, eps, D, HALF, BLOCK_D)
    else:
        _norm_rope_head(k_ptr + n * stride_kn + (head - H) * stride_kh, k_scale_ptr, cos_row, sin_row,
                        k_out_ptr + (n * HKV + head - H) * D, eps, D, HALF, BLOCK_D)


def draft_qk_norm_rope_triton(q: Tensor, k: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor,
                              eps: float) -> tuple[Tensor, Tensor]:
    """``draft_qk_norm_rope_torch`` by one kernel: q ``[N, H, D]``, k ``[N, Hkv, D]`` (any row and head
    strides, unit last stride: views into the projections); q_scale, k_scale fp32 ``[D]``; cos, sin fp32
    ``[N, rd/2]``. Returns (q, k) contiguous in the inputs' dtype."""
    rows, heads, head_dim = q.shape
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != rows or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(f"q {list(q.shape)} {q.dtype}, k {list(k.shape)} {k.dtype}: expected [N, H, D] and "
                         "[N, Hkv, D] of one dtype")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q strides {q.stride()}, k strides {k.stride()}: expected a unit last stride")
    half = _check_norm_and_rope(q_scale, k_scale, cos, sin, rows, head_dim)
    kv_heads = k.shape[1]
    q_out = torch.empty((rows, heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((rows, kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if rows == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(head_dim)
    _draft_qk_norm_rope_kernel[(rows, heads + kv_heads)](
        q, k, q_scale, k_scale, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), float(eps), H=heads, HKV=kv_heads, D=head_dim, HALF=half, BLOCK_D=block_d,
        PDL=pdl_enabled(q.device), num_warps=max(1, min(4, block_d // 64)), **launch_options(q.device))
    return q_out, k_out


def output_gate_torch(attn: Tensor, gate: Tensor) -> Tensor:
    """``attn * sigmoid(gate)``: attn, gate ``[N, H, D]``. Returns ``[N, H*D]`` in attn's dtype."""
    return (attn * torch.sigmoid(gate)).reshape(attn.shape[0], -1)


@triton.jit
def _output_gate_kernel(attn_ptr, gate_ptr, out_ptr, stride_an, stride_ah, stride_gn, stride_gh,
                        D: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < WIDTH
    head, d = e // D, e % D
    a = tl.load(attn_ptr + n * stride_an + head * stride_ah + d, mask=mask, other=0.0)
    g = tl.load(gate_ptr + n * stride_gn + head * stride_gh + d, mask=mask, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty).to(tl.float32)  # sigmoid in the gate's dtype
    tl.store(out_ptr + n * WIDTH + e, (a.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


def output_gate_triton(attn: Tensor, gate: Tensor) -> Tensor:
    """``output_gate_torch`` by the kernel: attn, gate ``[N, H, D]`` of one dtype (unit last stride)."""
    if attn.dim() != 3 or gate.shape != attn.shape or attn.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(f"attn {list(attn.shape)} {attn.stride()}, gate {list(gate.shape)} {gate.stride()}: "
                         "expected [N, H, D] twice with unit last stride")
    if gate.dtype != attn.dtype:
        raise ValueError(f"gate dtype {gate.dtype}: expected attn's {attn.dtype}")
    rows, heads, dim = attn.shape
    out = torch.empty((rows, heads * dim), dtype=attn.dtype, device=attn.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(heads * dim))
    _output_gate_kernel[(rows, triton.cdiv(heads * dim, block))](
        attn, gate, out, attn.stride(0), attn.stride(1), gate.stride(0), gate.stride(1), D=dim, WIDTH=heads * dim,
        BLOCK=block, num_warps=4)
    return out


qk_norm_rope = KernelOp("qk_norm_rope", qk_norm_rope_torch, GpuForm(qk_norm_rope_triton))
draft_qk_norm_rope = KernelOp("draft_qk_norm_rope", draft_qk_norm_rope_torch, GpuForm(draft_qk_norm_rope_triton))
output_gate = KernelOp("output_gate", output_gate_torch, GpuForm(output_gate_triton))
