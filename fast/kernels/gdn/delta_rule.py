"""The gated delta rule of a step's sequences as two ops (twin of ``reference/model/delta_rule.py``).

:data:`gated_delta_rule`, from given starting states: q, k ``[N, Hk, Dk]`` (q already scaled; key head i
serves value heads i*r .. i*r+r-1), v ``[N, Hv, Dv]``, g, beta ``[N, Hv]``, states fp32 ``[B, Hv, Dk, Dv]``,
the step's ``StepMeta`` and ``verify_rows`` (a verify's ``VerifyRowInputs``, which receives every row's k, v,
g, beta; None otherwise). Returns ``(o [N, Hv, Dv] fp32, final states [B, Hv, Dk, Dv] fp32)``. Forms: the torch
loop over time (:func:`gated_delta_rule_torch`); on CUDA flash-linear-attention's chunked kernels for a prefill
of a bf16/fp16 model where fla is installed (``gdn_prefill.py``), else the Triton recurrence
(``gdn_recurrent.py``).

:data:`gdn_recurrence`, over the state slot pool itself (``recurrent_storage [S, Hv, Dk, Dv]``): each sequence
starts from its slot (zeros where ``meta.zero_state``) and, unless the step is a verify, its final state is
written back to the slot. Its torch form gathers the starting states, runs :data:`gated_delta_rule` and writes
the final states back; its GPU form, for decode and verify steps, hands the Triton recurrence the pool and each
sequence's slot (``meta.readable_state_index``) and has it write decode and short prefill states in place (up
to ``SHORT_PREFILL_ROWS`` rows a sequence): no state-sized copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.dispatch import GpuForm, KernelOp
from .gdn_prefill import fla_available, gated_delta_rule_prefill_fla
from .gdn_recurrent import (VerifyRowInputs, delta_rule_step_torch, gated_delta_rule_verify_triton,
                            store_row_inputs_torch)


def gated_delta_rule_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, meta,
                           verify_rows: VerifyRowInputs | None) -> tuple[Tensor, Tensor]:
    """The gated delta rule per sequence, a loop over time, in fp32 (module docstring for the arguments).

    Each row is ``delta_rule_step_torch``, the step the torch commit replays, so the replayed state
    is this loop's state after the same rows, bit for bit.
    """
    if verify_rows is not None:
        store_row_inputs_torch(verify_rows, meta.seq_index, meta.row_in_seq, k, v, g, beta)
    ratio = v.shape[1] // q.shape[1]
    q, k = (meta.pad(t.float().repeat_interleave(ratio, dim=1)) for t in (q, k))  # [B, Tq, Hv, Dk]
    v, g, beta = (meta.pad(t.float()) for t in (v, g, beta))  # [B, Tq, Hv, Dv], [B, Tq, Hv] x2
    s = state.float().clone()  # [B, Hv, Dk, Dv]
    q_rows = q[..., None, :]  # [B, Tq, Hv, 1, Dk]: o_t as a [1, Dk] @ [Dk, Dv] matmul per head
    outputs = []
    for t in range(meta.max_query_len):
        s = delta_rule_step_torch(s, k[:, t], v[:, t], g[:, t], beta[:, t])  # S_t
        outputs.append((q_rows[:, t] @ s)[..., 0, :])  # o_t = S_t^T q_t
    return meta.unpad(torch.stack(outputs, dim=1)), s


def _prefill_fla(q, k, v, g, beta, state, meta, verify_rows):
    # one sequence: no sequence table, so fla reads none on the host (its chunk index is built from cu_seqlens
    # with a device-to-host copy), and the step can be captured in a CUDA graph (engine/graphs/prefill_graphs.py)
    return gated_delta_rule_prefill_fla(q, k, v, g, beta, state, None if meta.num_seqs == 1 else meta.cu_seqlens)


def _fits_fla(q, k, v, g, beta, state, meta, verify_rows) -> bool:
    return verify_rows is None and meta.max_query_len > 1 and v.dtype != torch.float32 and fla_available()


def _recurrent_triton(q, k, v, g, beta, state, meta, verify_rows):
    return gated_delta_rule_verify_triton(q, k, v, g, beta, state, meta.cu_seqlens, meta.max_query_len,
                                          verify_rows=verify_rows)


gated_delta_rule = KernelOp("gated_delta_rule", gated_delta_rule_torch, GpuForm(_prefill_fla, fits=_fits_fla),
                            GpuForm(_recurrent_triton))


def gdn_recurrence_gathered(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, recurrent_storage: Tensor,
                            meta, verify_rows: VerifyRowInputs | None) -> Tensor:
    """:data:`gdn_recurrence` by a gathered copy of the starting states and :data:`gated_delta_rule`. Returns
    o ``[N, Hv, Dv]`` fp32. ``torch.where`` rather than a multiply, so a NaN in an ignored slot is never read."""
    start = torch.where(meta.zero_state[:, None, None, None], 0.0, recurrent_storage[meta.state_index])
    o, final = gated_delta_rule(q, k, v, g, beta, start, meta, verify_rows)
    if verify_rows is None:
        recurrent_storage.index_copy_(0, meta.state_index, final.float())
    return o


def gdn_recurrence_in_place_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                   recurrent_storage: Tensor, meta, verify_rows: VerifyRowInputs | None) -> Tensor:
    """:data:`gdn_recurrence` by the Triton recurrence reading (and, decoding, writing) the slots in place."""
    o, _ = gated_delta_rule_verify_triton(q, k, v, g, beta, recurrent_storage, meta.cu_seqlens, meta.max_query_len,
                                          state_index=meta.readable_state_index, verify_rows=verify_rows,
                                          output_final_state=False,
                                          final_state_index=None if meta.is_verify else meta.state_index)
    return o


# Prefill chunks of at most this many rows a sequence take the recurrence in place too, not fla's chunked kernels: a
# short chunk (a chat turn resumed from the prefix cache) is bound by the host, and fla's pipeline costs about 2 ms
# of host time a layer under cProfile (58 of the 200 ms a 129-row turn of the 35B-A3B took: bench/results/
# 2026-12-07e-h100-serve-prefill/hostp35.log) where the recurrence is one launch, with no gathered copy of the
# states. Its device time grows with the rows (one row after another): at 129 rows an estimated 50-100 us a layer,
# near fla's; 256 is where that estimate still stays within a few ms a forward (not yet measured:
# bench/kernels/bench_gdn_verify.py --prefill-rows). The captured prefill steps (engine/graphs/prefill_graphs.py)
# bound each chunk by it, so their GDN layers take this one-launch form, which reads no layout on the host.
SHORT_PREFILL_ROWS = 256


def _fits_in_place(q, k, v, g, beta, recurrent_storage, meta, verify_rows) -> bool:
    return meta.is_verify or meta.max_query_len <= SHORT_PREFILL_ROWS


gdn_recurrence = KernelOp("gdn_recurrence", gdn_recurrence_gathered, GpuForm(gdn_recurrence_in_place_triton,
                                                                             fits=_fits_in_place))
