"""The DFlash 2 draft's sublayer input: RMSNorm, the dynamic taps and side 0 of the grouped conv in one
kernel, twin of ``reference/model/conv.conv_prepare`` on ``reference/model/draft.qwen3_rms_norm``.

B blocks of S rows of the residual stream ``x [B, S, C]``, C channels in groups of G (NG = C/G
groups), K taps; row i of block b::

    u_i     = (w * x_i / sqrt(mean(x_i^2) + eps))  in fp32, rounded to x's dtype    (Qwen3 norm, w fp32 [C])
    delta_i = W_kp u_i                             [2*K*NG] = [side, tap, group], rounded to x's dtype
    u'_i[c] = sum_{tau < K, tau <= i} (base[0, tau, c] + delta_i[0, tau, c // G]) * u_{i - tau}[c]

W_kp ``[2*K*NG, C]`` and base ``[2, K, C]`` in x's dtype. Returns ``(u' [B, S, C], delta [B, S, 2, K, NG])``
in x's dtype; the whole delta leaves (the conv finish reads side 1). Taps never cross a block start.

``norm_conv_prepare_torch`` is the composition the draft ran before this kernel, op for op: the norm
(``fast/model/norm.rms_norm``), one 2-D GEMM in x's dtype, ``grouped_dynamic_conv_torch`` on side 0.

``norm_conv_prepare_triton``: one kernel instead of three launches (norm, a cuBLAS GEMM that is
launch-bound at 8 rows x 2 MiB of W_kp, the conv). Grid (row tiles, group tiles):

* a row tile is ``blocks_per_tile`` whole blocks (``TILE_ROWS`` = 2 x 8 rows at release), padded to
  ``BLOCK_M`` >= 16 rows for ``tl.dot``. Whole blocks, because a tap never leaves its block, so the
  conv needs no neighbouring tile;
* a group tile is ``GT`` groups (4 at release: 64 channels, 32 programs per row tile at C = 2048,
  G = 16). Its W_kp rows are ``side*K*NG + tau*NG + g`` for both sides, all taps and its groups
  (2*K*GT = 16 rows at release, the N of the dot), which is also their flat index in a delta row.

Each program: pass 1 sums x^2 of its rows over all C (every group tile of a row tile recomputes it:
a 64 KiB re-read from L2, cheaper than a second launch; chunked, so its summation order is not the
add_rms_norm kernel's); pass 2 walks C in ``BLOCK_K`` chunks (the last one masked: any C), forms u
with the add_rms_norm kernel's expression (``(x * rstd) * w`` in fp32, rounded) and accumulates
``u @ W_kp_rows^T`` in fp32 (IEEE fp32 for fp32 inputs, not tf32; under Triton's interpreter the
16-bit tiles go to fp32 first, see the launcher); it stores its delta columns
(rounded) and the rounded u of its own GT*G channels into the u' buffer, syncs the CTA, then runs
the conv on those channels as ``dynamic_conv``'s kernel does (fp32 taps of the rounded delta and u,
tap 0 first, one rounding) reading delta and the shifted rows u_{i-tau} back, syncs again, and
overwrites its u' channels with the result. No program reads what another program writes.

Bound: launch latency and L2 (W_kp is read once per row tile, x 2 x C/(GT*G) times). Deterministic,
no host sync, a grid fixed by the shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..model.norm import rms_norm
from .dynamic_conv import grouped_dynamic_conv_torch
from .triton_compat import tl, triton, use_triton

MIN_TILE_ROWS = 16  # tl.dot needs M >= 16: a row tile holds max(1, 16 // S) whole blocks
GROUPS_PER_PROGRAM = 4  # GT: 2*K*GT = 16 W_kp rows per program at K = 2 (the dot's N), 64 channels at G = 16
MAX_BLOCK_K = 256  # channels of one reduction step: a [16, 256] u tile and a [16, 256] W_kp tile
NUM_WARPS = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: Tensor, norm_weight: Tensor, kernel_projection: Tensor, base: Tensor, group_size: int) -> None:
    if x.dim() != 3:
        raise ValueError(f"x {list(x.shape)}: expected [B, S, C] (the block rows of the residual stream)")
    channels = x.shape[2]
    if group_size < 1 or channels % group_size:
        raise ValueError(f"group_size={group_size} does not divide C={channels}")
    if norm_weight.shape != (channels,) or norm_weight.dtype != torch.float32:
        raise ValueError(f"norm_weight {list(norm_weight.shape)} {norm_weight.dtype}: expected fp32 [{channels}] "
                         "(the Qwen3 norm's weight as stored)")
    if base.dim() != 3 or base.shape[0] != 2 or base.shape[2] != channels or base.dtype != x.dtype:
        raise ValueError(f"base {list(base.shape)} {base.dtype}: expected [2, K, {channels}] in x's {x.dtype}")
    expected = (2 * base.shape[1] * (channels // group_size), channels)
    if kernel_projection.shape != expected or kernel_projection.dtype != x.dtype:
        raise ValueError(f"kernel_projection {list(kernel_projection.shape)} {kernel_projection.dtype}: expected "
                         f"{list(expected)} ([2*K*C/G, C]) in x's {x.dtype}")
    for name, t in (("x", x), ("norm_weight", norm_weight), ("kernel_projection", kernel_projection),
                    ("base", base)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def norm_conv_prepare_torch(x: Tensor, norm_weight: Tensor, eps: float, kernel_projection: Tensor, base: Tensor,
                            group_size: int) -> tuple[Tensor, Tensor]:
    """The module docstring's ``(u', delta)`` by the unfused ops (norm, GEMM, conv tap loop), in x's dtype."""
    _check(x, norm_weight, kernel_projection, base, group_size)
    batch, rows, channels = x.shape
    taps = base.shape[1]
    u = rms_norm(x.reshape(batch * rows, channels), norm_weight, eps, x.dtype)  # [B*S, C]
    delta = (u @ kernel_projection.T).view(batch, rows, 2, taps, channels // group_size)  # one 2-D GEMM
    return grouped_dynamic_conv_torch(u.view(batch, rows, channels), base[0], delta[:, :, 0], group_size), delta


@triton.jit
def _norm_conv_prepare_kernel(x_ptr, w_ptr, proj_ptr, base_ptr, u_ptr, delta_ptr, stride_xb, stride_xs, stride_p,
                              stride_bk, eps, num_rows, S: tl.constexpr, C: tl.constexpr, G: tl.constexpr,
                              NG: tl.constexpr, K: tl.constexpr, GT: tl.constexpr, TILE_ROWS: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_CG: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    r = tl.arange(0, BLOCK_M)
    rows = tl.program_id(0) * TILE_ROWS + r  # b*S + i; the tile starts at a block start
    live_row = (r < TILE_ROWS) & (rows < num_rows)
    i = rows % S
    x_rows = x_ptr + (rows // S).to(tl.int64) * stride_xb + i * stride_xs  # [BLOCK_M] row starts

    # pass 1: rstd of every row of the tile over all C
    sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_rows[:, None] + k[None, :], mask=live_row[:, None] & (k < C)[None, :], other=0.0)
        xv = xv.to(tl.float32)
        sum_sq += xv * xv
    rstd = tl.math.rsqrt(tl.sum(sum_sq, axis=1) / C + eps)  # [BLOCK_M]

    # pass 2: delta columns of this program's groups, u recomputed per chunk and rounded before the dot
    n = tl.arange(0, BLOCK_N)
    g = tl.program_id(1) * GT + n % GT
    live_n = (n < 2 * K * GT) & (g < NG)
    p = (n // (K * GT)) * (K * NG) + ((n // GT) % K) * NG + g  # W_kp row of (side, tap, group) = delta index
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < C
        xv = tl.load(x_rows[:, None] + k[None, :], mask=live_row[:, None] & in_k[None, :], other=0.0)
        wv = tl.load(w_ptr + k, mask=in_k, other=0.0)
        u = ((xv.to(tl.float32) * rstd[:, None]) * wv[None, :]).to(u_ptr.dtype.element_ty)  # add_rms_norm's rounding
        wp = tl.load(proj_ptr + p[:, None].to(tl.int64) * stride_p + k[None, :],
                     mask=live_n[:, None] & in_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K], contiguous along C
        if DOT_FP32:  # the interpreter: the same products (exact in fp32), fp32 sums
            acc = tl.dot(u.to(tl.float32), tl.trans(wp).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(u, tl.trans(wp), acc, input_precision=DOT_PRECISION)
    delta_rows = delta_ptr + rows.to(tl.int64) * (2 * K * NG)  # [BLOCK_M] starts of contiguous delta rows
    tl.store(delta_rows[:, None] + p[None, :], acc.to(delta_ptr.dtype.element_ty),
             mask=live_row[:, None] & live_n[None, :])

    # the conv on this program's GT*G channels: the rounded u goes to the u' buffer first, so that the
    # shifted rows u_{i-tau} and the per-channel delta (both written by other threads of this program)
    # can be read back after a CTA barrier
    cl = tl.arange(0, BLOCK_CG)
    cc = tl.program_id(1) * (GT * G) + cl
    live_c = (cl < GT * G) & (cc < C)
    mask = live_row[:, None] & live_c[None, :]
    xv = tl.load(x_rows[:, None] + cc[None, :], mask=mask, other=0.0)
    wv = tl.load(w_ptr + cc, mask=live_c, other=0.0)
    u = ((xv.to(tl.float32) * rstd[:, None]) * wv[None, :]).to(u_ptr.dtype.element_ty)  # pass 2's u, bit for bit
    u_rows = u_ptr + rows.to(tl.int64) * C
    tl.store(u_rows[:, None] + cc[None, :], u, mask=mask)
    tl.debug_barrier()  # delta and u of every thread are stored before any read below
    y = tl.zeros([BLOCK_M, BLOCK_CG], dtype=tl.float32)
    for tau in tl.static_range(K):  # dynamic_conv's order: tap 0 first, (base + delta) * u in fp32
        live = mask & (i >= tau)[:, None]  # the tap reaches a row of this block
        uv = tl.load(u_rows[:, None] - tau * C + cc[None, :], mask=live, other=0.0).to(tl.float32)
        bv = tl.load(base_ptr + tau * stride_bk + cc, mask=live_c, other=0.0).to(tl.float32)
        dv = tl.load(delta_rows[:, None] + tau * NG + (cc // G)[None, :], mask=live, other=0.0).to(tl.float32)
        y += (bv[None, :] + dv) * uv
    tl.debug_barrier()  # every read of u above happens before u' overwrites it
    tl.store(u_rows[:, None] + cc[None, :], y.to(u_ptr.dtype.element_ty), mask=mask)


def norm_conv_prepare_triton(x: Tensor, norm_weight: Tensor, eps: float, kernel_projection: Tensor, base: Tensor,
                             group_size: int, groups_per_program: int = GROUPS_PER_PROGRAM,
                             blocks_per_tile: int | None = None,
                             max_block_k: int = MAX_BLOCK_K, num_warps: int = NUM_WARPS) -> tuple[Tensor, Tensor]:
    """``norm_conv_prepare_torch`` by one kernel: x any strides with a unit channel stride, the weights
    contiguous along C. Returns a contiguous u' ``[B, S, C]`` and delta ``[B, S, 2, K, C/G]`` in x's dtype.

    ``groups_per_program`` (GT), ``blocks_per_tile`` (default max(1, 16 // S)), ``max_block_k`` (a power
    of two >= 16) and ``num_warps`` set the tiling; the tests shrink them to reach the masks,
    bench/kernels/bench_draft_kernels.py sweeps them.
    """
    _check(x, norm_weight, kernel_projection, base, group_size)
    if x.dtype not in DTYPES:
        raise ValueError(f"x is {x.dtype}: expected one of {[str(d) for d in DTYPES]}")
    for name, t in (("x", x), ("norm_weight", norm_weight), ("kernel_projection", kernel_projection),
                    ("base", base)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: strides {t.stride()}: expected a unit channel stride")
    batch, rows, channels = x.shape
    taps, groups = base.shape[1], channels // group_size
    blocks_per_tile = max(1, MIN_TILE_ROWS // rows) if blocks_per_tile is None else blocks_per_tile
    if groups_per_program < 1 or blocks_per_tile < 1:
        raise ValueError(f"groups_per_program={groups_per_program}, blocks_per_tile={blocks_per_tile}: expected >= 1")
    if max_block_k < 16 or max_block_k & (max_block_k - 1):
        raise ValueError(f"max_block_k={max_block_k}: expected a power of two >= 16")
    u_out = torch.empty((batch, rows, channels), dtype=x.dtype, device=x.device)
    delta = torch.empty((batch, rows, 2, taps, groups), dtype=x.dtype, device=x.device)
    if u_out.numel() == 0:
        return u_out, delta
    tile_rows = blocks_per_tile * rows
    gt = min(groups_per_program, groups)
    grid = (triton.cdiv(batch, blocks_per_tile), triton.cdiv(groups, gt))
    _norm_conv_prepare_kernel[grid](
        x, norm_weight, kernel_projection, base, u_out, delta, x.stride(0), x.stride(1), kernel_projection.stride(0),
        base.stride(1), float(eps), batch * rows, S=rows, C=channels, G=group_size, NG=groups, K=taps, GT=gt,
        TILE_ROWS=tile_rows, BLOCK_M=max(16, triton.next_power_of_2(tile_rows)),
        BLOCK_N=max(16, triton.next_power_of_2(2 * taps * gt)),
        BLOCK_K=max(16, min(max_block_k, triton.next_power_of_2(channels))),
        BLOCK_CG=triton.next_power_of_2(gt * group_size),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 stays fp32; tf32 unused for 16-bit
        # Triton 3.6's interpreter (CPU tensors) multiplies 16-bit dot tiles as their uint16 bit patterns:
        # there the tiles go up to fp32 first (a product of two bf16/fp16 values is exact in fp32)
        DOT_FP32=not x.is_cuda,
        num_warps=num_warps)
    return u_out, delta


def norm_conv_prepare(x: Tensor, norm_weight: Tensor, eps: float, kernel_projection: Tensor, base: Tensor,
                      group_size: int) -> tuple[Tensor, Tensor]:
    """The engine's entry point: one kernel on CUDA, the unfused torch ops elsewhere."""
    fn = norm_conv_prepare_triton if use_triton(x, norm_weight, kernel_projection, base) else norm_conv_prepare_torch
    return fn(x, norm_weight, eps, kernel_projection, base, group_size)
