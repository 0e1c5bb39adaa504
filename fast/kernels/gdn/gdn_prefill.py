"""The gated delta rule over whole prompt chunks, by flash-linear-attention's chunked kernels; twin
of ``reference/model/delta_rule.gated_delta_rule_recurrent`` (its chunked form,
``gated_delta_rule_chunked``, derives what these kernels compute).

Same inputs as ``delta_rule.gated_delta_rule``: the rows of B sequences flattened with
``cu_seqlens [B+1]``; q, k ``[N, Hk, Dk]`` already L2-normalised, q already scaled by
``Dk^-1/2``; v ``[N, Hv, Dv]``; g (log-decay) and beta ``[N, Hv]``. Sequence b starts from
``initial_state[state_index[b]]`` (default row b; a negative index starts from zeros). Returns
``(o [N, Hv, Dv] fp32, final states [B, Hv, Dk, Dv] fp32)``.

fla 0.6.0 ``chunk_gated_delta_rule`` conventions, checked in its source
(fla/ops/gated_delta_rule/chunk.py, common/chunk_delta_h.py): inputs ``[1, N, H, D]`` (batch 1
with ``cu_seqlens``; there is no head-first layout any more); value head h reads key head
``h // (Hv / Hk)`` (GVA, as our repeat of key heads); ``g`` in log space (``use_gate_in_kernel``
off); ``beta`` after the sigmoid; ``scale=1.0`` because q arrives scaled, and
``use_qk_l2norm_in_kernel=False`` because q and k arrive normalised; ``initial_state``
``[B, Hv, Dk, Dv]`` (K-first, ``state_v_first`` off) read in fp32, the final state returned fp32.

Its matrix products run on tensor cores (bf16, or tf32 for fp32 inputs), so this path serves
bf16 and fp16 models, within their NUMERIC bounds; it refuses fp32 values, whose bound (1e-5) the
tf32 products miss (fp32 models take ``gdn_recurrent``). q, k and beta go in v's dtype, g in fp32.

flash-linear-attention is optional: it is imported on first use, on CUDA only
(``fla_available`` says whether it can be, ``fla_unavailable_reason`` why not).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch
from torch import Tensor

from .gdn_recurrent import check_gdn_inputs


@functools.cache
def fla_unavailable_reason() -> str | None:
    """Why flash-linear-attention's ``fla.ops.gated_delta_rule`` cannot be used here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed"
    try:
        _chunk_gated_delta_rule()
    except Exception as e:  # an installed fla that fails to import (a dependency, a version clash)
        reason = f"flash-linear-attention does not import: {type(e).__name__}: {e}"
        warnings.warn(f"{reason}; GDN prefill falls back to the Triton recurrence", stacklevel=2)
        return reason
    return None


def fla_available() -> bool:
    """Whether flash-linear-attention's chunked kernels can run here (CUDA and an importable fla)."""
    return fla_unavailable_reason() is None


@functools.cache
def _chunk_gated_delta_rule():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def gated_delta_rule_prefill_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
                                 cu_seqlens: Tensor | None, *, state_index: Tensor | None = None
                                 ) -> tuple[Tensor, Tensor]:
    """q, k [N, Hk, Dk], v [N, Hv, Dv] (bf16 or fp16), g, beta [N, Hv], initial_state fp32 [S, Hv, Dk, Dv],
    cu_seqlens [B+1] on CUDA, or None for one sequence of all N rows (fla then reads nothing on the host).
    Returns ``(o [N, Hv, Dv] fp32, final states [B, Hv, Dk, Dv] fp32)``."""
    check_gdn_inputs(q, k, v, g, beta, initial_state)
    rows, key_heads, key_dim = q.shape
    _, value_heads, value_dim = v.shape
    batch = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"v is {v.dtype}: the fla chunked path is for bf16/fp16 (its tf32 products miss the "
                         f"fp32 bound); use gdn_recurrent for fp32")
    if not q.is_cuda:
        raise ValueError("gated_delta_rule_prefill_fla runs on CUDA tensors only")
    if state_index is None:
        h0 = initial_state[:batch].float()
    else:
        readable = state_index >= 0
        h0 = torch.where(readable[:, None, None, None], initial_state[state_index.clamp(min=0)].float(), 0.0)
    dtype = v.dtype
    o, final = _chunk_gated_delta_rule()(
        q.to(dtype)[None], k.to(dtype)[None], v[None], g.float()[None], beta.to(dtype)[None], scale=1.0,
        initial_state=h0.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=False,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    return o[0].float(), final.float()
