"""Gated full attention over paged K/V, batched over sequences (twin of reference/model/attention.py).

For the normalised input rows ``x [N, C]`` at absolute positions p::

    [q_h, gate_h] = (W_q x)[h];  q = RoPE_p(rmsnorm_q(q));  k = RoPE_p(rmsnorm_k(W_k x));  v = W_v x
    write k, v at the row's K/V slot (padding rows: the trash row)
    a_h = softmax_{t <= p}(q_h . k_{j(h), t} / sqrt(D)) v_{j(h), t}   over the sequence's paged context
    y   = W_o [a_h * sigmoid(gate_h)]_h                                  j(h) = h // (H/Hkv)

W_q, W_k and W_v are fused into one matmul. The prologue (norms, RoPE, the K/V write), the attention core
and the output gate are ops of ``fast/kernels/attention/`` (each a torch twin and a kernel, one dispatch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from ..kernels.attention.attention_prologue import output_gate, qk_norm_rope
from ..kernels.attention.paged_attention import paged_attention
from .linear import linear
from .params import Params, zero_centred_scale
from .pools import PagedKV
from .step import StepMeta


class FastAttention:
    """One gated full-attention mixer, reading ``{prefix}self_attn.*``."""

    ops = (qk_norm_rope, paged_attention, output_gate)  # the kernel ops it runs (FastTarget.capturable)

    def __init__(self, cfg: TargetConfig, params: Params, prefix: str):
        p = f"{prefix}self_attn."
        self.cfg = cfg
        self.dtype = params.dtype
        self.w_qkv = params.fused(f"{p}q_proj.weight", f"{p}k_proj.weight", f"{p}v_proj.weight")  # [2HD + 2HkvD, C]
        self.w_o = params.weight(f"{p}o_proj.weight")  # [C, H D]
        self.q_scale = zero_centred_scale(params.get(f"{p}q_norm.weight", torch.float32))  # [D]
        self.k_scale = zero_centred_scale(params.get(f"{p}k_norm.weight", torch.float32))  # [D]

    def forward(self, x: Tensor, meta: StepMeta, kv: PagedKV) -> Tensor:
        """x: ``[N, C]`` after input_layernorm. Writes the rows' K/V into ``kv``; returns ``[N, C]``."""
        cfg = self.cfg
        rows, h, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        qkv = linear(x, self.w_qkv)  # [N, H 2D + 2 Hkv D]
        gate = qkv[:, :2 * h * d].view(rows, h, 2 * d)[..., d:]  # [N, H, D]: per head [query D | gate D]
        q = qk_norm_rope(qkv, self.q_scale, self.k_scale, meta.rope_cos, meta.rope_sin, eps, h, hkv, kv.key_storage,
                         kv.value_storage, meta.kv_write_index)  # [N, H, D]; the rows' K/V are written
        attn = paged_attention(q, kv.key_storage, kv.value_storage, meta)  # [N, H, D]
        return linear(output_gate(attn, gate), self.w_o)  # [N, C]
