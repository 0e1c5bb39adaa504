"""The Gated DeltaNet (GDN) token mixer of the Qwen3.5 linear-attention layers.

For the normalised layer input ``x_t`` (``[C]``), with Hk key heads of width Dk and Hv value heads
of width Dv (Hv a multiple of Hk)::

    c_t        = W_qkv x_t                                    [2 Hk Dk + Hv Dv]
    c'_t       = silu( sum_{j<K} w_j * c_{t-K+1+j} )          causal depthwise conv, kernel K, no bias
    q, k, v    = split(c'_t)                                  [Hk, Dk], [Hk, Dk], [Hv, Dv]
    q          = l2norm(q) / sqrt(Dk);  k = l2norm(k)         l2norm(y) = y / sqrt(sum y^2 + 1e-6)
    g_t        = -exp(A_log) * softplus(W_a x_t + dt_bias)    [Hv] log-decay, <= 0
    beta_t     = sigmoid(W_b x_t)                             [Hv]
    o_t        = gated delta rule (reference/model/delta_rule.py)   [Hv, Dv]; key head i serves
                                                              value heads i*r .. i*r + r-1, r = Hv/Hk
    y_t        = W_out  gated_rms_norm(o_t, z_t = W_z x_t)    per value head, weight applied as is

The conv sees inputs before the first token as zeros. Its state holds the last K-1 conv inputs
(oldest first), so a step-by-step run and a whole-sequence run see the same window. The delta rule
runs as the plain loop over time; its chunked twin is checked against it in the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..formats.config import TargetConfig
from .delta_rule import gated_delta_rule_recurrent
from .norm import gated_rms_norm

L2NORM_EPS = 1e-6  # inside the sqrt, as flash-linear-attention and transformers use it


@dataclass
class GDNState:
    """The per-layer memory of a GDN layer (fp32)."""

    conv: Tensor  # [conv_dim, K-1] the last K-1 inputs of the conv, oldest first
    recurrent: Tensor  # [Hv, Dk, Dv] the delta-rule state S

    @classmethod
    def zeros(cls, cfg: TargetConfig) -> GDNState:
        return cls(
            conv=torch.zeros(cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1),
            recurrent=torch.zeros(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        )

    def clone(self) -> GDNState:
        return GDNState(conv=self.conv.clone(), recurrent=self.recurrent.clone())


def causal_conv1d(x: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv over time, continuing from ``conv_state``; no activation.

    ``y_t[c] = sum_{j<K} weight[c, j] * x_{t-K+1+j}[c]``, where inputs before this call come from
    ``conv_state``. x: ``[T, N]``; conv_state: ``[N, K-1]``; weight: ``[N, K]``.
    Returns ``(y [T, N], new conv_state [N, K-1])``.
    """
    kernel = weight.shape[1]
    steps = x.shape[0]
    window = torch.cat([conv_state.transpose(0, 1), x], dim=0)  # [K-1+T, N]
    y = sum(weight[:, j] * window[j:j + steps] for j in range(kernel))  # [T, N]
    return y, window[steps:].transpose(0, 1).clone()


def l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + L2NORM_EPS)


class GatedDeltaNet:
    """One GDN token mixer, reading ``{prefix}linear_attn.*`` from the canonical weights."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], prefix: str):
        p = f"{prefix}linear_attn."
        self.cfg = cfg
        self.w_qkv = weights[f"{p}in_proj_qkv.weight"]  # [2 Hk Dk + Hv Dv, C]
        self.w_z = weights[f"{p}in_proj_z.weight"]  # [Hv Dv, C]
        self.w_b = weights[f"{p}in_proj_b.weight"]  # [Hv, C]
        self.w_a = weights[f"{p}in_proj_a.weight"]  # [Hv, C]
        self.conv_weight = weights[f"{p}conv1d.weight"][:, 0, :]  # [conv_dim, K]
        self.dt_bias = weights[f"{p}dt_bias"]  # [Hv]
        self.a_log = weights[f"{p}A_log"]  # [Hv]
        self.norm_weight = weights[f"{p}norm.weight"]  # [Dv]
        self.w_out = weights[f"{p}out_proj.weight"]  # [C, Hv Dv]

    def forward(self, x: Tensor, state: GDNState) -> Tensor:
        """x: ``[T, C]`` (after input_layernorm). Returns ``[T, C]``; ``state`` moves on by T tokens."""
        cfg = self.cfg
        steps = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim

        conv_in = x @ self.w_qkv.T  # [T, conv_dim]
        conv_out, state.conv = causal_conv1d(conv_in, state.conv, self.conv_weight)
        conv_out = F.silu(conv_out)
        q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
        q = l2norm(q.reshape(steps, hk, dk)) / dk ** 0.5  # [T, Hk, Dk]
        k = l2norm(k.reshape(steps, hk, dk))  # [T, Hk, Dk]
        v = v.reshape(steps, hv, dv)  # [T, Hv, Dv]
        # Key head i serves the r = Hv/Hk consecutive value heads i*r .. i*r + r-1.
        q = q.repeat_interleave(hv // hk, dim=1)  # [T, Hv, Dk]
        k = k.repeat_interleave(hv // hk, dim=1)  # [T, Hv, Dk]

        g = -torch.exp(self.a_log) * F.softplus(x @ self.w_a.T + self.dt_bias)  # [T, Hv]
        beta = torch.sigmoid(x @ self.w_b.T)  # [T, Hv]
        o, state.recurrent = gated_delta_rule_recurrent(q, k, v, g, beta, state.recurrent)  # [T, Hv, Dv]

        z = (x @ self.w_z.T).reshape(steps, hv, dv)  # [T, Hv, Dv]
        o = gated_rms_norm(o, z, self.norm_weight, cfg.rms_norm_eps)  # [T, Hv, Dv]
        return o.reshape(steps, hv * dv) @ self.w_out.T  # [T, C]
