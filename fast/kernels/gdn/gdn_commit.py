"""The GDN verify commit in one launch for every linear-attention layer: rollback by replay, as the
reference does it (``reference/speculative/loop.verify_step`` re-runs the kept rows from a snapshot);
twin of the torch form ``commit_verify_torch`` below.

A verify step never writes the slots, so each slot still holds its pre-step state; what it keeps,
for the sequence at batch index b and its row r, is the row's recurrence inputs (``verify_rows``,
a :class:`~.gdn_recurrent.VerifyRowInputs`: k, v, g, beta at ``[l, b, r]``) and the row's conv
input (``verify_conv_inputs[l, b, r]``). The commit installs the state after row ``kept_b - 1``
(kept = num_accepted + 1, in 1 .. R) into the sequence's slot ``slot_b = state_index[b]``, per layer l::

    S                     = recurrent[l, slot_b]  (zeros where zero_state[b])                      fp32
    S                     = S'_r + k_r u_r^T,  S'_r = exp(g_r) S,  u_r = beta_r (v_r - S'_r^T k_r)  r = 0 .. kept_b-1
    recurrent[l, slot_b]  = S
    window_b              = [conv[l, slot_b] (zeros where zero_state[b]) ; verify_conv_inputs[l, b, 0..R-1]^T]
    conv[l, slot_b][:, t] = window_b[:, kept_b + t]        t < K-1                                 pool dtype

(k repeated to the value heads: head h reads key head ``h // (Hv / Hk)``; window position p < K-1 is
the pre-step state's column p, else input row p - (K-1) <= kept_b - 1; rows past the kept ones are
never read, and a zero-state sequence never reads its slot, so a NaN there cannot leak).

Shapes, with a leading layer axis L (the pools stack their GDN tensors so that one launch serves
every layer): conv_storage ``[L, S, Cd, K-1]`` and verify_conv_inputs ``[L, >= B, R, Cd]`` in the
pool dtype, recurrent_storage fp32 ``[L, S, Hv, Dk, Dv]``, verify_rows k fp32 ``[L, >= B, R, Hk, Dk]``,
v ``[L, >= B, R, Hv, Dv]``, g, beta fp32 ``[L, >= B, R, Hv]``; state_index, kept ``[B]`` integer;
zero_state ``[B]`` bool.

Exactness. The conv part is a copy: the kernel equals the torch form bit for bit. The replay is
bit for bit the state the verify kernel reached after row kept_b - 1 (and the state a decode-style
run of the same rows gives): its state programs are the recurrence kernel's (fast/kernels/gdn/gdn_recurrent.py),
one per (value head, Dv block of ``block_v``) on a ``[DK_PAD, block_v]`` tile with the same
``NUM_WARPS``, loading the state tile and the row inputs as it does and calling the same
``delta_rule_step``; rows r >= kept_b are dropped (the row loop is unrolled and branch-free, a select keeps
the state of row kept_b - 1). The torch form replays with
``delta_rule_step_torch`` per layer, as ``gated_delta_rule_verify_torch`` runs the rows, so it
equals that run bit for bit; kernel and torch form agree to fp32 rounding (NUMERIC). Wherever two
sequences write one slot (padding sequences all write the trash slot) it holds one of them; nothing
reads it.

Grid ``(Hv * cdiv(Dv, block_v) + conv tiles, B, L)``, fixed by the shapes (no host sync, graph-capturable:
kept is read on the device). A state program reads its tile of the slot, replays the kept rows
in registers and (after a CTA barrier) writes the tile back in place. A conv tile owns ``block_c``
whole channels of one sequence's slot: it reads every pre-step tap it needs, then (after a CTA
barrier) rewrites those channels, so the in-place shift never reads a tap another program or
thread has already rewritten. Bound: HBM bandwidth, the slot's state read and written once
(2 x 2 MiB per layer and sequence at Hv = 32, Dk = Dv = 128) plus the kept rows' inputs; the
replay's fp32 arithmetic (about 6 flops per state element and kept row, 25 MFLOP per layer and
sequence at R = 8) comes to roughly a third of that traffic's time at a Hopper GPU's bandwidth and fp32
rate, an estimate: the measured fraction of the floor is bench/kernels/bench_gdn_verify.py's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gdn_recurrent import (NUM_WARPS, VerifyRowInputs, check_verify_rows, default_block_v, delta_rule_step,
                            delta_rule_step_torch)
from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

BLOCK_C = 256  # conv channels per conv tile


def _check(conv_storage: Tensor, recurrent_storage: Tensor, verify_conv_inputs: Tensor,
           verify_rows: VerifyRowInputs, state_index: Tensor, zero_state: Tensor, kept: Tensor) -> None:
    if conv_storage.dim() != 4 or recurrent_storage.dim() != 5:
        raise ValueError(f"conv_storage {list(conv_storage.shape)}, recurrent_storage {list(recurrent_storage.shape)}:"
                         " expected [L, S, Cd, K-1] and [L, S, Hv, Dk, Dv]")
    layers, slots, conv_dim, _ = conv_storage.shape
    batch = state_index.shape[0]
    if recurrent_storage.shape[:2] != (layers, slots):
        raise ValueError(f"recurrent_storage {list(recurrent_storage.shape)}: expected [{layers}, {slots}, ...]")
    if recurrent_storage.dtype != torch.float32:
        raise ValueError(f"recurrent_storage {recurrent_storage.dtype}: expected fp32")
    if (verify_conv_inputs.dim() != 4 or verify_conv_inputs.shape[0] != layers or verify_conv_inputs.shape[1] < batch
            or verify_conv_inputs.shape[3] != conv_dim):
        raise ValueError(f"verify_conv_inputs {list(verify_conv_inputs.shape)}: expected [{layers}, >= {batch}, R, "
                         f"{conv_dim}]")
    if verify_conv_inputs.dtype != conv_storage.dtype:
        raise ValueError(f"verify_conv_inputs {verify_conv_inputs.dtype}: expected the conv pool's "
                         f"{conv_storage.dtype}")
    value_heads, key_dim, value_dim = recurrent_storage.shape[2:]
    key_heads = verify_rows.k.shape[-2] if verify_rows.k.dim() == 5 else 0
    if key_heads < 1 or value_heads % key_heads:
        raise ValueError(f"verify_rows.k {list(verify_rows.k.shape)}: expected [{layers}, B', R, Hk, {key_dim}] "
                         f"with Hk dividing {value_heads}")
    seqs_rows = check_verify_rows(verify_rows, (layers,), key_heads, key_dim, value_heads, value_dim)
    if seqs_rows != tuple(verify_conv_inputs.shape[1:3]):
        raise ValueError(f"verify_rows [{layers}, {seqs_rows[0]}, {seqs_rows[1]}, ...]: expected the conv "
                         f"scratch's [{layers}, {verify_conv_inputs.shape[1]}, {verify_conv_inputs.shape[2]}, ...]")
    if state_index.dim() != 1 or zero_state.shape != (batch,) or kept.shape != (batch,):
        raise ValueError(f"state_index {list(state_index.shape)}, zero_state {list(zero_state.shape)}, kept "
                         f"{list(kept.shape)}: expected [B] each")


def commit_verify_torch(conv_storage: Tensor, recurrent_storage: Tensor, verify_conv_inputs: Tensor,
                        verify_rows: VerifyRowInputs, state_index: Tensor, zero_state: Tensor, kept: Tensor) -> None:
    """Install each sequence's state after row ``kept[b] - 1`` into slot ``state_index[b]`` of every layer,
    replaying the kept rows from the slot's state (shapes in the module docstring); ``kept`` in 1 .. R.
    ``torch.where`` rather than a multiply keeps a NaN in a zero-state sequence's slot, or in a row
    past the kept ones, from being read."""
    _check(conv_storage, recurrent_storage, verify_conv_inputs, verify_rows, state_index, zero_state, kept)
    batch, taps = state_index.shape[0], conv_storage.shape[-1]
    state_index, kept = state_index.long(), kept.long()
    conv = torch.where(zero_state[None, :, None, None], 0.0, conv_storage[:, state_index])  # [L, B, Cd, K-1]
    window = torch.cat([conv, verify_conv_inputs[:, :batch].transpose(2, 3)], dim=3)  # [L, B, Cd, K-1+R]
    window_index = (kept[:, None] + torch.arange(taps, device=kept.device))[None, :, None, :]  # [1, B, 1, K-1]
    new_conv = window.gather(3, window_index.expand(*window.shape[:3], taps))  # [L, B, Cd, K-1]
    conv_storage.index_copy_(1, state_index, new_conv.to(conv_storage.dtype))

    rows, ratio = verify_conv_inputs.shape[2], recurrent_storage.shape[2] // verify_rows.k.shape[-2]
    kept_rows = torch.arange(rows, device=kept.device)[None, :] < kept[:, None]  # [B, R]
    for layer in range(recurrent_storage.shape[0]):  # per layer: the verify's own [B, Hv, Dk, Dv] shapes
        s = torch.where(zero_state[:, None, None, None], 0.0, recurrent_storage[layer, state_index])
        k, v, g, beta = (t[layer, :batch] for t in verify_rows)
        k = k.repeat_interleave(ratio, dim=2)  # [B, R, Hv, Dk]
        for r in range(rows):
            stepped = delta_rule_step_torch(s, k[:, r], v[:, r].float(), g[:, r], beta[:, r])
            s = torch.where(kept_rows[:, r, None, None, None], stepped, s)
        recurrent_storage[layer].index_copy_(0, state_index, s)


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit
def _gdn_commit_kernel(conv_ptr, rec_ptr, vconv_ptr, rows_k_ptr, rows_v_ptr, rows_g_ptr, rows_beta_ptr,
                       state_index_ptr, zero_state_ptr, kept_ptr, stride_cl, stride_cs, stride_cc, stride_rl,
                       stride_rs, stride_vcl, stride_vcb, stride_vcr, scratch_seqs, conv_dim,
                       ROWS: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, RATIO: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
                       V_BLOCKS: tl.constexpr, TAPS: tl.constexpr, TAPS_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    slot = tl.load(state_index_ptr + b).to(tl.int64)
    kept = tl.load(kept_ptr + b).to(tl.int64)
    kept = tl.minimum(tl.maximum(kept, 1), ROWS)  # stays in the scratch whatever a padding sequence holds
    readable = tl.load(zero_state_ptr + b) == 0  # a zero-state sequence reads nothing of its slot
    if tile < HV * V_BLOCKS:  # the recurrent state: replay rows 0 .. kept-1 on one [Dk, BLOCK_V] tile
        h = tile // V_BLOCKS
        key_head = h // RATIO
        dk = tl.arange(0, DK_PAD)
        in_k = dk < DK
        dv = (tile % V_BLOCKS) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_v = dv < DV
        in_s = in_k[:, None] & in_v[None, :]
        s_offs = h * (DK * DV) + dk[:, None] * DV + dv[None, :]  # within one [Hv, Dk, Dv] state
        state = rec_ptr + layer * stride_rl + slot * stride_rs
        s = tl.load(state + s_offs, mask=in_s & readable, other=0.0).to(tl.float32)
        first_row = (layer * scratch_seqs + b) * ROWS  # the dense [L, B', R, ...] scratch
        # unrolled, branch-free: every row's loads may issue up front (a kept row's loads waited on the
        # previous row's branch); a row past kept runs on zeros and its result is dropped by the select
        for r in tl.static_range(ROWS):
            live = r < kept
            n = first_row + r
            k = tl.load(rows_k_ptr + n * (HK * DK) + key_head * DK + dk, mask=in_k & live, other=0.0).to(tl.float32)
            v = tl.load(rows_v_ptr + n * (HV * DV) + h * DV + dv, mask=in_v & live, other=0.0).to(tl.float32)
            g = tl.load(rows_g_ptr + n * HV + h, mask=live, other=0.0).to(tl.float32)
            beta = tl.load(rows_beta_ptr + n * HV + h, mask=live, other=0.0).to(tl.float32)
            s = tl.where(live, delta_rule_step(s, k, v, g, beta), s)
        tl.debug_barrier()  # every thread's read of the old tile happens before any write of the new one
        tl.store(state + s_offs, s, mask=in_s)
    else:  # BLOCK_C whole channels of the conv state: window positions kept .. kept + K-2
        c = (tile - HV * V_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.arange(0, TAPS_PAD)
        in_tile = (c < conv_dim)[:, None] & (t < TAPS)[None, :]
        pos = kept + t  # [TAPS_PAD]
        from_state = (pos < TAPS)[None, :]
        state_row = conv_ptr + layer * stride_cl + slot * stride_cs + c[:, None] * stride_cc  # [BLOCK_C, 1]
        old = tl.load(state_row + pos[None, :], mask=in_tile & from_state & readable, other=0.0)
        row = tl.maximum(pos - TAPS, 0)  # the input row of window position pos
        inputs = tl.load(vconv_ptr + layer * stride_vcl + b * stride_vcb + row[None, :] * stride_vcr + c[:, None],
                         mask=in_tile & ~from_state, other=0.0)
        new = tl.where(from_state, old, inputs)  # a select, not a sum: -0.0 and NaN payloads copy as they are
        tl.debug_barrier()  # every read of the old taps above happens before any write below
        tl.store(state_row + t[None, :], new.to(conv_ptr.dtype.element_ty), mask=in_tile)


def commit_verify_triton(conv_storage: Tensor, recurrent_storage: Tensor, verify_conv_inputs: Tensor,
                         verify_rows: VerifyRowInputs, state_index: Tensor, zero_state: Tensor, kept: Tensor, *,
                         block_v: int | None = None, block_c: int = BLOCK_C) -> None:
    """``commit_verify_torch`` by the kernel (same arguments and effect); ``block_v`` (the recurrence's,
    default ``default_block_v(Dv)``: give the verify's own for a bitwise replay) and ``block_c``
    (powers of two) are the Dv slice per state program and the channels per conv tile. A ``kept``
    outside 1 .. R is clamped into it (the torch form would raise): the kernel never reads past the
    scratch."""
    _check(conv_storage, recurrent_storage, verify_conv_inputs, verify_rows, state_index, zero_state, kept)
    layers, _, conv_dim, taps = conv_storage.shape
    value_heads, key_dim, value_dim = recurrent_storage.shape[2:]
    key_heads = verify_rows.k.shape[-2]
    batch, (scratch_seqs, rows) = state_index.shape[0], verify_conv_inputs.shape[1:3]
    if not recurrent_storage[0, 0].is_contiguous():
        raise ValueError("recurrent_storage: expected dense [Hv, Dk, Dv] states")
    if not all(t.is_contiguous() for t in verify_rows):
        raise ValueError("verify_rows: expected contiguous tensors")
    if conv_storage.stride(3) != 1 or verify_conv_inputs.stride(3) != 1:
        raise ValueError("conv_storage, verify_conv_inputs: expected unit last strides")
    if batch == 0 or layers == 0:
        return
    block_v = default_block_v(value_dim) if block_v is None else block_v
    v_blocks = triton.cdiv(value_dim, block_v)
    grid = (value_heads * v_blocks + triton.cdiv(conv_dim, block_c), batch, layers)
    _gdn_commit_kernel[grid](
        conv_storage, recurrent_storage, verify_conv_inputs, *verify_rows, state_index.contiguous(),
        zero_state.contiguous(), kept.contiguous(), conv_storage.stride(0), conv_storage.stride(1),
        conv_storage.stride(2), recurrent_storage.stride(0), recurrent_storage.stride(1),
        verify_conv_inputs.stride(0), verify_conv_inputs.stride(1), verify_conv_inputs.stride(2), scratch_seqs,
        conv_dim, ROWS=rows, HK=key_heads, HV=value_heads, RATIO=value_heads // key_heads, DK=key_dim, DV=value_dim,
        DK_PAD=triton.next_power_of_2(key_dim), BLOCK_V=block_v, V_BLOCKS=v_blocks, TAPS=taps,
        TAPS_PAD=triton.next_power_of_2(max(taps, 1)), BLOCK_C=block_c, num_warps=NUM_WARPS)


gdn_commit = KernelOp("gdn_commit", commit_verify_torch, GpuForm(commit_verify_triton))
