"""The Gated DeltaNet mixer over state slots, batched over sequences (twin of reference/model/gdn.py).

For the normalised input rows x (one fused matmul gives c, z, b, a)::

    c'     = silu(causal depthwise conv of c, continuing from the slot's last K-1 inputs)
    q, k, v = split(c');  q = l2norm(q) / sqrt(Dk);  k = l2norm(k)
    g      = -exp(A_log) * softplus(a + dt_bias);   beta = sigmoid(b)
    o      = gated delta rule from the slot's recurrent state (reference/model/delta_rule.py)
    y      = W_out gated_rms_norm(o, z)

Each sequence starts from its slot (or from zeros: ``StepMeta.zero_state``). A prefill or decode
step writes the final conv and recurrent states back to the slot. A verify step
(``is_verify``) leaves the slots alone and fills the verify scratch instead (rollback by replay):
every row's conv input and its recurrence inputs (k, v, g, beta: a ``VerifyRowInputs``), from
which ``pools.commit_verify`` replays the kept rows on the slot's pre-step state.

Everything between the input projection and the recurrence (verify-input capture, the conv and
its state, silu, the L2 norms, g and beta) is :func:`gdn_prologue`: on CUDA, decode and verify
steps run it as one kernel (fast/kernels/gdn_prologue.py) when the conv op is the default, and
the gated output norm as another (fast/kernels/rms_norm.py). The conv and the recurrence are ops
(:attr:`ModelOps.causal_conv1d`, :attr:`ModelOps.gated_delta_rule`); the torch forms below pad the
rows to ``[B, Tq, ...]`` and loop the recurrence over time. Padded steps leave the state exactly
unchanged (g = 0, beta = 0, k = 0), so the state after the loop is each sequence's own final
state. :func:`gated_delta_rule`, the op's default, sends CUDA tensors to the kernels
(fast/kernels/gdn_recurrent.py, fast/kernels/gdn_prefill.py) and everything else to the torch
form; with it, decode and verify steps read the starting states from the slot pool in place, and
decode steps write the final states back into it in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from ..kernels.gdn_prefill import fla_available, gated_delta_rule_prefill_fla
from ..kernels.gdn_prologue import gdn_prologue_triton
from ..kernels.gdn_recurrent import (VerifyRowInputs, delta_rule_step_torch, gated_delta_rule_verify_triton,
                                     store_row_inputs_torch)
from ..kernels.triton_compat import use_triton
from .norm import gated_rms_norm
from .params import Params
from .pools import GDNSlots
from .step import StepMeta

L2NORM_EPS = 1e-6  # inside the sqrt, as the reference


def l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def causal_conv1d_torch(x: Tensor, conv_state: Tensor, weight: Tensor, meta: StepMeta) -> tuple[Tensor, Tensor]:
    """``silu`` of the causal depthwise conv per sequence, continuing from ``conv_state``.

    x: ``[N, Cd]`` conv inputs; conv_state: ``[B, Cd, K-1]`` each sequence's last K-1 inputs
    (oldest first); weight: ``[Cd, K]``. Returns ``(y [N, Cd] in x's dtype, final state [B, Cd, K-1])``.
    Computed in fp32.
    """
    kernel, steps = weight.shape[1], meta.max_query_len
    window = torch.cat([conv_state.transpose(1, 2).float(), meta.pad(x).float()], dim=1)  # [B, K-1+Tq, Cd]
    w = weight.float()
    y = sum(w[:, j] * window[:, j:j + steps] for j in range(kernel))  # [B, Tq, Cd]
    last = (meta.seq_lens[:, None] + torch.arange(kernel - 1, device=x.device))[:, :, None]  # [B, K-1, 1]
    final = window.gather(1, last.expand(-1, -1, window.shape[2])).transpose(1, 2)  # [B, Cd, K-1]
    return meta.unpad(F.silu(y)).to(x.dtype), final.to(conv_state.dtype)


def gated_delta_rule_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, meta: StepMeta,
                           verify_rows: VerifyRowInputs | None) -> tuple[Tensor, Tensor]:
    """The gated delta rule per sequence, a loop over time (reference/model/delta_rule.py), in fp32.

    q, k: ``[N, Hk, Dk]`` (q already scaled; key head i serves value heads i*r .. i*r+r-1);
    v: ``[N, Hv, Dv]``; g, beta: ``[N, Hv]``; state: fp32 ``[B, Hv, Dk, Dv]`` the starting states.
    ``verify_rows`` (verify): receives every row's k, v, g, beta at ``[seq_index, row_in_seq]``
    (fast/kernels/gdn_recurrent.py). Returns ``(o [N, Hv, Dv] fp32, final states [B, Hv, Dk, Dv] fp32)``.
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


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, meta: StepMeta,
                     verify_rows: VerifyRowInputs | None) -> tuple[Tensor, Tensor]:
    """``gated_delta_rule_torch``'s contract, by the kernels on CUDA.

    Decode and verify steps (and any fp32 step) run the Triton recurrence, which stores the verify
    rows' inputs as it walks them. Prefill steps of a bf16/fp16 model run fla's chunked kernels
    where flash-linear-attention is installed, else the same Triton recurrence.
    """
    if not use_triton(q, k, v, state):
        return gated_delta_rule_torch(q, k, v, g, beta, state, meta, verify_rows)
    if verify_rows is None and meta.max_query_len > 1 and v.dtype != torch.float32 and fla_available():
        return gated_delta_rule_prefill_fla(q, k, v, g, beta, state, meta.cu_seqlens)
    return gated_delta_rule_verify_triton(q, k, v, g, beta, state, meta.cu_seqlens, meta.max_query_len,
                                          verify_rows=verify_rows)


def gdn_prologue_torch(conv_in: Tensor, b: Tensor, a: Tensor, conv_states: Tensor, conv_weight: Tensor,
                       neg_decay: Tensor, dt_bias: Tensor, meta: StepMeta, key_heads: int, key_dim: int,
                       verify_inputs: Tensor | None = None, causal_conv1d=causal_conv1d_torch
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
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
    conv_out, final = causal_conv1d(conv_in, start, conv_weight, meta)  # [N, Cd]
    if verify_inputs is None:
        conv_states.index_copy_(0, meta.state_index, final.to(conv_states.dtype))
    q, k, v = torch.split(conv_out, [key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    q = l2norm(q.reshape(rows, key_heads, key_dim)) / key_dim ** 0.5  # [N, Hk, Dk] fp32
    k = l2norm(k.reshape(rows, key_heads, key_dim))  # [N, Hk, Dk] fp32
    g = neg_decay * F.softplus(a.float() + dt_bias)  # [N, Hv]
    beta = torch.sigmoid(b.float())  # [N, Hv]
    return q, k, v.reshape(rows, value_heads, value_dim), g, beta


def gdn_prologue(conv_in: Tensor, b: Tensor, a: Tensor, conv_states: Tensor, conv_weight: Tensor, neg_decay: Tensor,
                 dt_bias: Tensor, meta: StepMeta, key_heads: int, key_dim: int, verify_inputs: Tensor | None = None,
                 causal_conv1d=causal_conv1d_torch) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``gdn_prologue_torch``'s contract. On CUDA with the default conv op, verify steps and decode steps
    (one row per sequence) run the fused kernel; prefill chunks and a replaced conv op the torch form."""
    if (causal_conv1d is causal_conv1d_torch and use_triton(conv_in, conv_states)
            and (verify_inputs is not None or meta.max_query_len == 1)):
        return gdn_prologue_triton(conv_in, b, a, conv_states, conv_weight, neg_decay, dt_bias, meta, key_heads,
                                   key_dim, verify_inputs)
    return gdn_prologue_torch(conv_in, b, a, conv_states, conv_weight, neg_decay, dt_bias, meta, key_heads, key_dim,
                              verify_inputs, causal_conv1d)


class FastGDN:
    """One GDN mixer, reading ``{prefix}linear_attn.*``."""

    def __init__(self, cfg: TargetConfig, params: Params, prefix: str, causal_conv1d, gated_delta_rule):
        p = f"{prefix}linear_attn."
        self.cfg = cfg
        self.dtype = params.dtype
        self.causal_conv1d, self.gated_delta_rule = causal_conv1d, gated_delta_rule
        # fused input projection: conv inputs (q, k, v), z, b, a
        self.w_in = params.fused(f"{p}in_proj_qkv.weight", f"{p}in_proj_z.weight", f"{p}in_proj_b.weight",
                                 f"{p}in_proj_a.weight")  # [Cd + Hv Dv + 2 Hv, C]
        self.conv_weight = params.get(f"{p}conv1d.weight")[:, 0, :].contiguous()  # [Cd, K]
        self.neg_decay = -torch.exp(params.get(f"{p}A_log", torch.float32))  # [Hv]
        self.dt_bias = params.get(f"{p}dt_bias", torch.float32)  # [Hv]
        self.norm_weight = params.get(f"{p}norm.weight", torch.float32)  # [Dv]
        self.w_out = params.get(f"{p}out_proj.weight")  # [C, Hv Dv]

    def forward(self, x: Tensor, meta: StepMeta, slots: GDNSlots) -> Tensor:
        """x: ``[N, C]`` after input_layernorm. Returns ``[N, C]``; updates the slots or the verify scratch."""
        cfg = self.cfg
        rows = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_in, z, b, a = torch.split(x @ self.w_in.T, [cfg.gdn_conv_dim, hv * dv, hv, hv], dim=-1)

        verify_inputs = None
        if meta.is_verify:
            scratch_seqs, scratch_rows = slots.verify_conv_inputs.shape[:2]
            if meta.num_seqs > scratch_seqs or meta.max_query_len > scratch_rows:
                raise ValueError(f"verify batch of {meta.num_seqs} sequences x {meta.max_query_len} rows exceeds the "
                                 f"scratch ({scratch_seqs} x {scratch_rows})")
            verify_inputs = slots.verify_conv_inputs
        q, k, v, g, beta = gdn_prologue(conv_in, b, a, slots.conv_storage, self.conv_weight, self.neg_decay,
                                        self.dt_bias, meta, hk, dk, verify_inputs, self.causal_conv1d)
        o = self._recurrence(q, k, v, g, beta, meta, slots)  # [N, Hv, Dv] fp32

        o = gated_rms_norm(o, z.reshape(rows, hv, dv), self.norm_weight, cfg.rms_norm_eps, self.dtype)
        return o.reshape(rows, hv * dv) @ self.w_out.T  # [N, C]

    def _recurrence(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, meta: StepMeta,
                    slots: GDNSlots) -> Tensor:
        """The gated delta rule from the slots' states; writes the final states back (on a verify step
        stores the rows' inputs in the verify scratch instead). Returns o ``[N, Hv, Dv]`` fp32.

        With the default op on CUDA, decode and verify steps hand the kernel the slot pool and each
        sequence's slot to read (``meta.readable_state_index``: -1 for the zero state, one ``where``
        per step) instead of a gathered copy of the states, and a decode step has the kernel write
        the final states into the slots in place: no state-sized copy at all, the same result.
        """
        verify_rows = slots.verify_rows if meta.is_verify else None
        if (self.gated_delta_rule is gated_delta_rule and use_triton(q, slots.recurrent_storage)
                and (meta.is_verify or meta.max_query_len == 1)):
            o, _ = gated_delta_rule_verify_triton(q, k, v, g, beta, slots.recurrent_storage, meta.cu_seqlens,
                                                  meta.max_query_len, state_index=meta.readable_state_index,
                                                  verify_rows=verify_rows, output_final_state=False,
                                                  final_state_index=None if meta.is_verify else meta.state_index)
            return o
        start = slots.read_recurrent(meta.state_index, meta.zero_state)
        o, final = self.gated_delta_rule(q, k, v, g, beta, start, meta, verify_rows)
        if not meta.is_verify:  # the prologue wrote the conv state
            slots.recurrent_storage.index_copy_(0, meta.state_index, final.float())
        return o
