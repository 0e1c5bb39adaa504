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
which the speculative commit (``fast/speculative/commit.py``) replays the kept rows on the slot's
pre-step state.

The ops are ``fast/kernels/gdn/``'s: ``gdn_prologue`` (everything between the input projection and the
recurrence: the verify-input capture, the conv and its state, silu, the L2 norms, g and beta),
``gdn_recurrence`` (the gated delta rule from and to the slots) and ``gated_rms_norm``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from ..kernels.dense.rms_norm import gated_rms_norm
from ..kernels.gdn.delta_rule import gated_delta_rule, gdn_recurrence
from ..kernels.gdn.gdn_prologue import gdn_prologue
from .linear import linear
from .params import Params
from .pools import GDNSlots
from .step import StepMeta


class FastGDN:
    """One GDN mixer, reading ``{prefix}linear_attn.*``."""

    ops = (gdn_prologue, gdn_recurrence, gated_delta_rule, gated_rms_norm)  # (FastTarget.capturable)

    def __init__(self, cfg: TargetConfig, params: Params, prefix: str):
        p = f"{prefix}linear_attn."
        self.cfg = cfg
        self.dtype = params.dtype
        # fused input projection: conv inputs (q, k, v), z, b, a
        self.w_in = params.fused(f"{p}in_proj_qkv.weight", f"{p}in_proj_z.weight", f"{p}in_proj_b.weight",
                                 f"{p}in_proj_a.weight")  # [Cd + Hv Dv + 2 Hv, C]
        self.conv_weight = params.get(f"{p}conv1d.weight")[:, 0, :].contiguous()  # [Cd, K]
        self.neg_decay = -torch.exp(params.get(f"{p}A_log", torch.float32))  # [Hv]
        self.dt_bias = params.get(f"{p}dt_bias", torch.float32)  # [Hv]
        self.norm_weight = params.get(f"{p}norm.weight", torch.float32)  # [Dv]
        self.w_out = params.weight(f"{p}out_proj.weight")  # [C, Hv Dv]

    def forward(self, x: Tensor, meta: StepMeta, slots: GDNSlots) -> Tensor:
        """x: ``[N, C]`` after input_layernorm. Returns ``[N, C]``; updates the slots or the verify scratch."""
        cfg = self.cfg
        rows = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_in, z, b, a = torch.split(linear(x, self.w_in), [cfg.gdn_conv_dim, hv * dv, hv, hv], dim=-1)

        verify_inputs = None
        if meta.is_verify:
            scratch_seqs, scratch_rows = slots.verify_conv_inputs.shape[:2]
            if meta.num_seqs > scratch_seqs or meta.max_query_len > scratch_rows:
                raise ValueError(f"verify batch of {meta.num_seqs} sequences x {meta.max_query_len} rows exceeds the "
                                 f"scratch ({scratch_seqs} x {scratch_rows})")
            verify_inputs = slots.verify_conv_inputs
        q, k, v, g, beta = gdn_prologue(conv_in, b, a, slots.conv_storage, self.conv_weight, self.neg_decay,
                                        self.dt_bias, meta, hk, dk, verify_inputs)
        verify_rows = slots.verify_rows if meta.is_verify else None
        o = gdn_recurrence(q, k, v, g, beta, slots.recurrent_storage, meta, verify_rows)  # [N, Hv, Dv] fp32

        o = gated_rms_norm(o, z.reshape(rows, hv, dv), self.norm_weight, cfg.rms_norm_eps, self.dtype)
        return linear(o.reshape(rows, hv * dv), self.w_out)  # [N, C]
