"""The GDN verify commit in one launch for every linear-attention layer, twin of the torch form
``commit_verify_torch`` below (the reference rolls the state back by replay instead:
``reference/speculative/loop.verify_step`` re-runs the kept rows from a snapshot).

A verify step leaves the slots alone and captures, for the sequence at batch index b, the recurrent
state after every row r (``verify_recurrent[b, r]``) and every row's conv input
(``verify_conv_inputs[b, r]``). The commit installs the state after row ``kept[b] - 1`` (kept =
num_accepted + 1, in 1 .. R) into the sequence's slot ``state_index[b]``, per layer l::

    recurrent[l, slot_b]       = verify_recurrent[l, b, kept_b - 1]                              fp32
    window_b                   = [conv[l, slot_b] (zeros where zero_state[b]) ; verify_conv_inputs[l, b, 0..R-1]^T]
    conv[l, slot_b][:, t]      = window_b[:, kept_b + t]        t < K-1                          pool dtype

(window position p < K-1 is the pre-step state's column p, else input row p - (K-1) <= kept_b - 1:
rows past the kept ones are never read). Both are copies: the kernel equals the torch form bit for
bit, wherever the written slots are distinct (padding sequences all write the trash slot, whose
content nothing reads).

Shapes, with a leading layer axis L (the pools stack their GDN tensors so that one launch serves
every layer): conv_storage ``[L, S, Cd, K-1]`` and verify_conv_inputs ``[L, >= B, R, Cd]`` in the
pool dtype, recurrent_storage fp32 ``[L, S, Hv, Dk, Dv]`` and verify_recurrent fp32
``[L, >= B, R, Hv, Dk, Dv]``; state_index, kept ``[B]`` integer; zero_state ``[B]`` bool.

Grid ``(state tiles + conv tiles, B, L)``, fixed by the shapes (no host sync, graph-capturable).
A state tile copies ``block`` consecutive fp32 of one dense ``[Hv, Dk, Dv]`` state (the bulk of the
bytes: 3 MiB per layer and sequence at Hv = 48, Dk = Dv = 128: a B = 1 commit of 48 layers runs about
9 000 state programs of vectorised loads, 16 KiB each). A conv tile owns ``block_c`` whole channels of
one sequence's slot: it reads every pre-step tap it needs, then (after a CTA barrier) rewrites those
channels, so the in-place shift never reads a tap another program or thread has already rewritten.
Bound: HBM bandwidth (read and write of the kept states), once per speculative step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_compat import tl, triton

BLOCK = 4096  # fp32 per state tile: 16 KiB, 32 per thread at 4 warps
BLOCK_C = 256  # conv channels per conv tile


def _check(conv_storage: Tensor, recurrent_storage: Tensor, verify_conv_inputs: Tensor, verify_recurrent: Tensor,
           state_index: Tensor, zero_state: Tensor, kept: Tensor) -> None:
    if conv_storage.dim() != 4 or recurrent_storage.dim() != 5:
        raise ValueError(f"conv_storage {list(conv_storage.shape)}, recurrent_storage {list(recurrent_storage.shape)}:"
                         " expected [L, S, Cd, K-1] and [L, S, Hv, Dk, Dv]")
    layers, slots, conv_dim, _ = conv_storage.shape
    batch = state_index.shape[0]
    if recurrent_storage.shape[:2] != (layers, slots):
        raise ValueError(f"recurrent_storage {list(recurrent_storage.shape)}: expected [{layers}, {slots}, ...]")
    if (verify_conv_inputs.dim() != 4 or verify_conv_inputs.shape[0] != layers or verify_conv_inputs.shape[1] < batch
            or verify_conv_inputs.shape[3] != conv_dim):
        raise ValueError(f"verify_conv_inputs {list(verify_conv_inputs.shape)}: expected [{layers}, >= {batch}, R, "
                         f"{conv_dim}]")
    rows = verify_conv_inputs.shape[2]
    if verify_recurrent.shape != (layers, verify_conv_inputs.shape[1], rows, *recurrent_storage.shape[2:]):
        raise ValueError(f"verify_recurrent {list(verify_recurrent.shape)}: expected "
                         f"[{layers}, {verify_conv_inputs.shape[1]}, {rows}, {list(recurrent_storage.shape[2:])}]")
    if recurrent_storage.dtype != torch.float32 or verify_recurrent.dtype != torch.float32:
        raise ValueError(f"recurrent states {recurrent_storage.dtype}, {verify_recurrent.dtype}: expected fp32")
    if verify_conv_inputs.dtype != conv_storage.dtype:
        raise ValueError(f"verify_conv_inputs {verify_conv_inputs.dtype}: expected the conv pool's "
                         f"{conv_storage.dtype}")
    if state_index.dim() != 1 or zero_state.shape != (batch,) or kept.shape != (batch,):
        raise ValueError(f"state_index {list(state_index.shape)}, zero_state {list(zero_state.shape)}, kept "
                         f"{list(kept.shape)}: expected [B] each")


def commit_verify_torch(conv_storage: Tensor, recurrent_storage: Tensor, verify_conv_inputs: Tensor,
                        verify_recurrent: Tensor, state_index: Tensor, zero_state: Tensor, kept: Tensor) -> None:
    """Install each sequence's state after row ``kept[b] - 1`` into slot ``state_index[b]`` of every layer
    (shapes in the module docstring); ``kept`` in 1 .. R. ``torch.where`` rather than a multiply keeps
    a NaN in a zero-state sequence's slot from being read."""
    _check(conv_storage, recurrent_storage, verify_conv_inputs, verify_recurrent, state_index, zero_state, kept)
    batch, taps = state_index.shape[0], conv_storage.shape[-1]
    state_index, kept = state_index.long(), kept.long()
    conv = torch.where(zero_state[None, :, None, None], 0.0, conv_storage[:, state_index])  # [L, B, Cd, K-1]
    window = torch.cat([conv, verify_conv_inputs[:, :batch].transpose(2, 3)], dim=3)  # [L, B, Cd, K-1+R]
    window_index = (kept[:, None] + torch.arange(taps, device=kept.device))[None, :, None, :]  # [1, B, 1, K-1]
    new_conv = window.gather(3, window_index.expand(*window.shape[:3], taps))  # [L, B, Cd, K-1]
    conv_storage.index_copy_(1, state_index, new_conv.to(conv_storage.dtype))
    kept_states = verify_recurrent[:, torch.arange(batch, device=kept.device), kept - 1]  # [L, B, Hv, Dk, Dv]
    recurrent_storage.index_copy_(1, state_index, kept_states)


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit
def _gdn_commit_kernel(conv_ptr, rec_ptr, vconv_ptr, vrec_ptr, state_index_ptr, zero_state_ptr, kept_ptr,
                       stride_cl, stride_cs, stride_cc, stride_rl, stride_rs, stride_vcl, stride_vcb, stride_vcr,
                       stride_vrl, stride_vrb, stride_vrr, state_elems, conv_dim, max_rows, state_tiles,
                       TAPS: tl.constexpr, TAPS_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    slot = tl.load(state_index_ptr + b).to(tl.int64)
    kept = tl.load(kept_ptr + b).to(tl.int64)
    kept = tl.minimum(tl.maximum(kept, 1), max_rows)  # stays in the scratch whatever a padding sequence holds
    if tile < state_tiles:  # the recurrent state after row kept - 1, a dense copy
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        in_state = offs < state_elems
        src = vrec_ptr + layer * stride_vrl + b * stride_vrb + (kept - 1) * stride_vrr
        dst = rec_ptr + layer * stride_rl + slot * stride_rs
        tl.store(dst + offs, tl.load(src + offs, mask=in_state), mask=in_state)
    else:  # BLOCK_C whole channels of the conv state: window positions kept .. kept + K-2
        c = (tile - state_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.arange(0, TAPS_PAD)
        in_tile = (c < conv_dim)[:, None] & (t < TAPS)[None, :]
        pos = kept + t  # [TAPS_PAD]
        from_state = (pos < TAPS)[None, :]
        readable = tl.load(zero_state_ptr + b) == 0  # a zero-state sequence reads nothing of its slot
        state_row = conv_ptr + layer * stride_cl + slot * stride_cs + c[:, None] * stride_cc  # [BLOCK_C, 1]
        old = tl.load(state_row + pos[None, :], mask=in_tile & from_state & readable, other=0.0)
        row = tl.maximum(pos - TAPS, 0)  # the input row of window position pos
        inputs = tl.load(vconv_ptr + layer * stride_vcl + b * stride_vcb + row[None, :] * stride_vcr + c[:, None],
                         mask=in_tile & ~from_state, other=0.0)
        new = tl.where(from_state, old, inputs)  # a select, not a sum: -0.0 and NaN payloads copy as they are
        tl.debug_barrier()  # every read of the old taps above happens before any write below
        tl.store(state_row + t[None, :], new.to(conv_ptr.dtype.element_ty), mask=in_tile)


def commit_verify_triton(conv_storage: Tensor, recurrent_storage: Tensor, verify_conv_inputs: Tensor,
                         verify_recurrent: Tensor, state_index: Tensor, zero_state: Tensor, kept: Tensor, *,
                         block: int = BLOCK, block_c: int = BLOCK_C, num_warps: int = 4) -> None:
    """``commit_verify_torch`` by the kernel (same arguments and effect); ``block``, ``block_c`` (powers of
    two) are the fp32 per state tile and the channels per conv tile. A ``kept`` outside 1 .. R is clamped
    into it (the torch form would raise): the kernel never reads past the scratch."""
    _check(conv_storage, recurrent_storage, verify_conv_inputs, verify_recurrent, state_index, zero_state, kept)
    layers, _, conv_dim, taps = conv_storage.shape
    batch, rows = state_index.shape[0], verify_conv_inputs.shape[2]
    state_elems = recurrent_storage[0, 0].numel()
    if not (recurrent_storage[0, 0].is_contiguous() and verify_recurrent[0, 0, 0].is_contiguous()):
        raise ValueError("recurrent_storage, verify_recurrent: expected dense [Hv, Dk, Dv] states")
    if conv_storage.stride(3) != 1 or verify_conv_inputs.stride(3) != 1:
        raise ValueError("conv_storage, verify_conv_inputs: expected unit last strides")
    if batch == 0 or layers == 0:
        return
    state_tiles = triton.cdiv(state_elems, block)
    grid = (state_tiles + triton.cdiv(conv_dim, block_c), batch, layers)
    _gdn_commit_kernel[grid](
        conv_storage, recurrent_storage, verify_conv_inputs, verify_recurrent, state_index.contiguous(),
        zero_state.contiguous(), kept.contiguous(), conv_storage.stride(0), conv_storage.stride(1),
        conv_storage.stride(2), recurrent_storage.stride(0), recurrent_storage.stride(1),
        verify_conv_inputs.stride(0), verify_conv_inputs.stride(1), verify_conv_inputs.stride(2),
        verify_recurrent.stride(0), verify_recurrent.stride(1), verify_recurrent.stride(2), state_elems, conv_dim,
        rows, state_tiles, TAPS=taps, TAPS_PAD=triton.next_power_of_2(max(taps, 1)), BLOCK=block, BLOCK_C=block_c,
        num_warps=num_warps)
