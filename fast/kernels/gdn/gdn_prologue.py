"""The Gated DeltaNet prologue: its torch form :func:`gdn_prologue_torch` and, for every step kind (decode,
verify, prefill chunks), one kernel (reference/model/gdn.py: the causal conv, silu, the L2 norms, the decay and
the write strength).

From the fused input projection's rows (conv inputs ``x [N, Cd]``, ``b, a [N, Hv]``), with the conv
continuing from each sequence's state (``conv_states[state_index[b]]``, the last K-1 inputs oldest
first; zeros where ``zero_state[b]``), row n = row r of sequence b::

    window_n  = [state_b ; x rows of b](r .. r + K-1)            window position p < K-1: state column p
    c_n       = silu( sum_{j<K} w[:, j] * window_n[r + j] )     fp32, rounded to the model dtype
    q, k, v   = split(c_n):  q = l2norm(q) / sqrt(Dk),  k = l2norm(k)   per key head, fp32; v as is
    g_n       = -exp(A_log) * softplus(a_n + dt_bias),   beta_n = sigmoid(b_n)                  fp32

and, by step kind:

- verify (``verify_inputs`` given): ``verify_inputs[b, r] = x_n`` (the conv input of every row, for
  ``speculative.commit.commit_verify``); the states are left alone;
- decode (one row per sequence): ``conv_states[state_index[b]] = window_n[1 .. K-1]``, the state
  after the row, written by the row's programs;
- prefill (several rows per sequence, no verify scratch): the state after the sequence's last row
  (window positions ``L_b .. L_b + K-2``: old state columns where ``L_b < K-1``, else the chunk's last
  K-1 inputs) is gathered first (:func:`final_conv_states`, a few sync-free torch ops on ``[B, Cd, K-1]``),
  the kernel writes no state, and the gathered states go to the slots after it: the sequence's first
  rows read the old state while no program rewrites it. (Before, prefill chunks ran the torch form: a
  padded ``[B, K-1+Tq, Cd]`` fp32 window and a dozen elementwise passes over ``[N, Cd]`` fp32 per layer.)

One program per (row, head): ``2 Hk`` programs for the q and k heads and ``Hv`` for the v heads
(each the conv of its ``Dk`` or ``Dv`` channels, K taps read straight from the state or the
projection rows), and one for the row's gates. Where a decode program rewrites its channels of the
state, a CTA barrier separates its reads of the old state from the writes. Padding sequences
(``zero_state``, the trash slot) read nothing and may rewrite the trash slot concurrently, which
nothing reads.

Bound: launch latency at decode sizes (the conv reads ``K * Cd`` values and writes ``~Cd``: tens of
KiB). Deterministic, no host sync, a grid fixed by N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

L2NORM_EPS = 1e-6  # inside the sqrt, as the reference


def l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def causal_conv1d_torch(x: Tensor, conv_state: Tensor, weight: Tensor, meta) -> tuple[Tensor, Tensor]:
    """``silu`` of the causal depthwise conv per sequence, continuing from ``conv_state``.

    x: ``[N, Cd]`` conv inputs; conv_state: ``[B, Cd, K-1]`` each sequence's last K-1 inputs
    (oldest first); weight: ``[Cd, K]``; ``meta`` the step's StepMeta. Returns ``(y [N, Cd] in x's dtype,
    final state [B, Cd, K-1])``. Computed in fp32.
    """
    kernel, steps = weight.shape[1], meta.max_query_len
    window = torch.cat([conv_state.transpose(1, 2).float(), meta.pad(x).float()], dim=1)  # [B, K-1+Tq, Cd]
    w = weight.float()
    y = sum(w[:, j] * window[:, j:j + steps] for j in range(kernel))  # [B, Tq, Cd]
    last = (meta.seq_lens[:, None] + torch.arange(kernel - 1, device=x.device))[:, :, None]  # [B, K-1, 1]
    final = window.gather(1, last.expand(-1, -1, window.shape[2])).transpose(1, 2)  # [B, Cd, K-1]
    return meta.unpad(F.silu(y)).to(x.dtype), final.to(conv_state.dtype)


def final_conv_states(x: Tensor, conv_states: Tensor, meta, kernel: int) -> Tensor:
    """Each sequence's conv state after the step: window positions ``L_b .. L_b + K-2`` of
    ``[state_b ; x rows of b]`` (``L_b`` = its rows; zeros for the state where ``zero_state``), in the
    states' dtype  # [B, Cd, K-1]. x: ``[N, Cd]``; conv_states ``[S, Cd, K-1]``. Copies only (exact)."""
    taps = torch.arange(kernel - 1, device=x.device)
    window = meta.seq_lens[:, None] + taps  # [B, K-1] window positions
    rows = (meta.cu_seqlens[:-1, None] + window - (kernel - 1)).clamp(0, max(x.shape[0] - 1, 0))  # [B, K-1]
    start = torch.where(meta.zero_state[:, None, None], 0.0, conv_states[meta.state_index])  # [B, Cd, K-1]
    old = start.gather(2, window.clamp(max=kernel - 2)[:, None, :].expand(-1, start.shape[1], -1))
    return torch.where((window >= kernel - 1)[:, None, :], x[rows].transpose(1, 2).to(old.dtype), old)


def gdn_prologue_torch(conv_in: Tensor, b: Tensor, a: Tensor, conv_states: Tensor, conv_weight: Tensor,
                       neg_decay: Tensor, dt_bias: Tensor, meta, key_heads: int, key_dim: int,
                       verify_inputs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """From the projection's conv inputs ``conv_in [N, Cd]`` and ``b, a [N, Hv]``: the recurrence's inputs.

    The conv continues from ``conv_states [S, Cd, K-1]`` at ``meta.state_index`` (zeros where
    ``meta.zero_state``); ``neg_decay`` = -exp(A_log) and ``dt_bias`` are fp32 ``[Hv]``. A verify
    step (``verify_inputs [>= B, >= Tq, Cd]`` given) stores every row's conv input at
    ``[seq_index, row_in_seq]`` and leaves the states alone; any other step writes each sequence's
    final conv state back to its slot. Returns ``(q, k [N, Hk, Dk] fp32 (q scaled by Dk^-1/2),
    v [N, Hv, Dv] in conv_in's dtype, g, beta [N, Hv] fp32)``.
    """
    rows, value_heads = conv_in.shape[0], b.shape[-1]
    value_dim = (conv_in.shape[1] - 2 * key_heads * key_dim) // value_heads
    if verify_inputs is not None:
        verify_inputs[meta.seq_index, meta.row_in_seq] = conv_in.to(verify_inputs.dtype)
    start = torch.where(meta.zero_state[:, None, None], 0.0, conv_states[meta.state_index])  # [B, Cd, K-1]
    conv_out, final = causal_conv1d_torch(conv_in, start, conv_weight, meta)  # [N, Cd]
    if verify_inputs is None:
        conv_states.index_copy_(0, meta.state_index, final.to(conv_states.dtype))
    q, k, v = torch.split(conv_out, [key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    q = l2norm(q.reshape(rows, key_heads, key_dim)) / key_dim ** 0.5  # [N, Hk, Dk] fp32
    k = l2norm(k.reshape(rows, key_heads, key_dim))  # [N, Hk, Dk] fp32
    g = neg_decay * F.softplus(a.float() + dt_bias)  # [N, Hv]
    beta = torch.sigmoid(b.float())  # [N, Hv]
    return q, k, v.reshape(rows, value_heads, value_dim), g, beta

L2NORM_EPS = 1e-6  # inside the sqrt, as reference/model/gdn.l2norm
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus's default: x above it is returned as is


@triton.jit
def _gdn_prologue_kernel(x_ptr, b_ptr, a_ptr, state_ptr, w_ptr, neg_decay_ptr, dt_bias_ptr, seq_index_ptr,
                         row_in_seq_ptr, state_index_ptr, zero_state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                         verify_ptr, stride_x, stride_b, stride_a, stride_ss, stride_sc, stride_vb, stride_vr,
                         sqrt_dk, HK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr,
                         K: tl.constexpr, TAPS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HV: tl.constexpr,
                         L2_EPS: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, VERIFY: tl.constexpr,
                         WRITE_STATE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < 2 * HK + HV:
        seq = tl.load(seq_index_ptr + n).to(tl.int64)
        r = tl.load(row_in_seq_ptr + n).to(tl.int64)
        slot = tl.load(state_index_ptr + seq).to(tl.int64)
        readable = tl.load(zero_state_ptr + seq) == 0  # a zero-state sequence reads nothing of its slot
        is_qk = head < 2 * HK
        base = tl.where(is_qk, head * DK, 2 * HK * DK + (head - 2 * HK) * DV)  # the head's first channel
        width = tl.where(is_qk, DK, DV)
        d = tl.arange(0, BLOCK_D)
        in_c = d < width
        c = base + d
        state_row = state_ptr + slot * stride_ss + c * stride_sc
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(K):
            pos = r + j  # window position of tap j: the state's column pos, or input row pos - (K-1)
            tap = tl.load(state_row + pos, mask=in_c & (pos < K - 1) & readable, other=0.0).to(tl.float32)
            tap += tl.load(x_ptr + (n + j - (K - 1)) * stride_x + c, mask=in_c & (pos >= K - 1),
                           other=0.0).to(tl.float32)
            acc += tl.load(w_ptr + c * K + j, mask=in_c, other=0.0).to(tl.float32) * tap
        y = acc / (1.0 + tl.exp(-acc))  # silu
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the conv output is rounded to the model dtype
        if is_qk:
            y = y * tl.math.rsqrt(tl.sum(y * y, axis=0) + L2_EPS)  # masked channels are 0
            if head < HK:
                tl.store(q_ptr + n * (HK * DK) + head * DK + d, y / sqrt_dk, mask=in_c)
            else:
                tl.store(k_ptr + n * (HK * DK) + (head - HK) * DK + d, y, mask=in_c)
        else:
            tl.store(v_ptr + n * (HV * DV) + (head - 2 * HK) * DV + d, y.to(v_ptr.dtype.element_ty), mask=in_c)
        if VERIFY:
            x_row = tl.load(x_ptr + n * stride_x + c, mask=in_c, other=0.0)
            tl.store(verify_ptr + seq * stride_vb + r * stride_vr + c, x_row.to(verify_ptr.dtype.element_ty),
                     mask=in_c)
        if WRITE_STATE:  # one row per sequence: the state after it is window positions 1 .. K-1
            i = tl.arange(0, TAPS_PAD)
            pos = r + 1 + i
            in_tile = in_c[:, None] & (i < K - 1)[None, :]
            new = tl.load(state_row[:, None] + pos[None, :], mask=in_tile & (pos < K - 1)[None, :] & readable,
                          other=0.0).to(tl.float32)
            new += tl.load(x_ptr + (n + 1 + i - (K - 1))[None, :] * stride_x + c[:, None],
                           mask=in_tile & (pos >= K - 1)[None, :], other=0.0).to(tl.float32)
            tl.debug_barrier()  # every read of the old state above happens before any write below
            tl.store(state_row[:, None] + i[None, :], new.to(state_ptr.dtype.element_ty), mask=in_tile)
    else:
        h = tl.arange(0, BLOCK_HV)
        in_h = h < HV
        a = tl.load(a_ptr + n * stride_a + h, mask=in_h, other=0.0).to(tl.float32)
        a += tl.load(dt_bias_ptr + h, mask=in_h, other=0.0)
        u = tl.exp(tl.minimum(a, SOFTPLUS_MAX))  # above the threshold softplus is a itself
        t = 1.0 + u
        log1p = tl.where(t == 1.0, u, tl.log(t) * (u / tl.where(t == 1.0, 1.0, t - 1.0)))  # log1p(u) to rounding
        softplus = tl.where(a > SOFTPLUS_MAX, a, log1p)
        g = tl.load(neg_decay_ptr + h, mask=in_h, other=0.0) * softplus
        tl.store(g_ptr + n * HV + h, g, mask=in_h)
        b = tl.load(b_ptr + n * stride_b + h, mask=in_h, other=0.0).to(tl.float32)
        tl.store(beta_ptr + n * HV + h, 1.0 / (1.0 + tl.exp(-b)), mask=in_h)


def gdn_prologue_triton(conv_in: Tensor, b: Tensor, a: Tensor, conv_states: Tensor, conv_weight: Tensor,
                        neg_decay: Tensor, dt_bias: Tensor, meta, key_heads: int, key_dim: int,
                        verify_inputs: Tensor | None = None, num_warps: int | None = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``gdn_prologue_torch`` by the kernel (same arguments and result; its ``causal_conv1d`` is built in).

    conv_in ``[N, Cd]``, b, a ``[N, Hv]`` (unit last stride: slices of the projection do);
    conv_states ``[S, Cd, K-1]``; conv_weight ``[Cd, K]`` contiguous; neg_decay (-exp(A_log)),
    dt_bias fp32 ``[Hv]``; ``meta`` the step's StepMeta (``seq_index``, ``row_in_seq``,
    ``state_index``, ``zero_state``, ``max_query_len``); verify_inputs ``[>= B, >= Tq, Cd]`` or None
    (a decode or prefill step: the states are updated, module docstring). Returns ``(q, k [N, Hk, Dk] fp32,
    v [N, Hv, Dv] in conv_in's dtype, g, beta [N, Hv] fp32)``.
    """
    rows, conv_dim = conv_in.shape
    value_heads = b.shape[-1]
    value_dim = (conv_dim - 2 * key_heads * key_dim) // value_heads if value_heads else 0
    if conv_dim != 2 * key_heads * key_dim + value_heads * value_dim or value_dim < 1:
        raise ValueError(f"conv_in width {conv_dim}: expected 2 * {key_heads} * {key_dim} + Hv * Dv with "
                         f"Hv = {value_heads}")
    for name, t in (("conv_in", conv_in), ("b", b), ("a", a)):
        if t.dim() != 2 or t.shape[0] != rows or t.stride(1) != 1:
            raise ValueError(f"{name}: {list(t.shape)} strides {t.stride()}: expected [{rows}, ...] rows with unit "
                             "last stride")
    if a.shape != b.shape:
        raise ValueError(f"a {list(a.shape)}: expected b's shape {list(b.shape)}")
    kernel = conv_weight.shape[-1]
    if conv_weight.shape != (conv_dim, kernel) or not conv_weight.is_contiguous():
        raise ValueError(f"conv_weight: {list(conv_weight.shape)}: expected contiguous [{conv_dim}, K]")
    if conv_states.dim() != 3 or conv_states.shape[1:] != (conv_dim, kernel - 1) or conv_states.stride(2) != 1:
        raise ValueError(f"conv_states: {list(conv_states.shape)} strides {conv_states.stride()}: expected "
                         f"[S, {conv_dim}, {kernel - 1}] with unit last stride")
    for name, t in (("neg_decay", neg_decay), ("dt_bias", dt_bias)):
        if t.shape != (value_heads,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name}: {list(t.shape)} {t.dtype}: expected contiguous fp32 [{value_heads}]")
    if verify_inputs is not None and (verify_inputs.dim() != 3 or verify_inputs.shape[0] < meta.num_seqs
                                      or verify_inputs.shape[1] < meta.max_query_len
                                      or verify_inputs.shape[2] != conv_dim or verify_inputs.stride(2) != 1):
        raise ValueError(f"verify_inputs: {list(verify_inputs.shape)}: expected [>= {meta.num_seqs}, "
                         f">= {meta.max_query_len}, {conv_dim}] with unit last stride")
    device = conv_in.device
    q = torch.empty((rows, key_heads, key_dim), dtype=torch.float32, device=device)
    k = torch.empty_like(q)
    v = torch.empty((rows, value_heads, value_dim), dtype=conv_in.dtype, device=device)
    g = torch.empty((rows, value_heads), dtype=torch.float32, device=device)
    beta = torch.empty_like(g)
    if rows == 0:
        return q, k, v, g, beta
    block_d = triton.next_power_of_2(max(key_dim, value_dim))
    verify = verify_inputs if verify_inputs is not None else v  # stands in for an unread pointer
    prefill = verify_inputs is None and meta.max_query_len > 1
    final = final_conv_states(conv_in, conv_states, meta, kernel) if prefill else None  # before any write
    _gdn_prologue_kernel[(rows, 2 * key_heads + value_heads + 1)](
        conv_in, b, a, conv_states, conv_weight, neg_decay, dt_bias, meta.seq_index, meta.row_in_seq,
        meta.state_index, meta.zero_state, q, k, v, g, beta, verify, conv_in.stride(0), b.stride(0), a.stride(0),
        conv_states.stride(0), conv_states.stride(1), verify.stride(0) if verify_inputs is not None else 0,
        verify.stride(1) if verify_inputs is not None else 0, float(key_dim) ** 0.5,
        HK=key_heads, DK=key_dim, HV=value_heads, DV=value_dim, K=kernel,
        TAPS_PAD=triton.next_power_of_2(max(kernel - 1, 1)), BLOCK_D=block_d,
        BLOCK_HV=triton.next_power_of_2(value_heads), L2_EPS=L2NORM_EPS, SOFTPLUS_MAX=SOFTPLUS_THRESHOLD,
        VERIFY=verify_inputs is not None,
        WRITE_STATE=verify_inputs is None and not prefill, num_warps=num_warps or max(1, min(4, block_d // 128)))
    if prefill:
        conv_states.index_copy_(0, meta.state_index, final)
    return q, k, v, g, beta


# every step kind on CUDA: decode, verify and prefill chunks (module docstring)
gdn_prologue = KernelOp("gdn_prologue", gdn_prologue_torch, GpuForm(gdn_prologue_triton))
