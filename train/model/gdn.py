"""Batched, differentiable Gated DeltaNet: the chunked delta rule and the GDN token mixer.

Twin of reference/model/gdn.py and reference/model/delta_rule.py for N sequences of equal
length T, all starting at position 0 from a zero state (training: no cache).

The rule (per sequence and value head, state ``S [Dk, Dv]``, ``S_0 = 0``)::

    S_t = e^{g_t} S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),   o_t = S_t^T q_t

Chunk form (chunk of L tokens, ``G_i = g_1 + .. + g_i`` inside it, ``S0`` the state entering it),
as derived in reference/model/delta_rule.py::

    (I + A) [U0 | W] = [B V | B e^G K]      A[i, j] = beta_i e^{G_i - G_j} k_i.k_j  (j < i), B = diag(beta)
    U     = U0 - W S0                       the corrections
    O     = (e^G Q) S0 + P U                P = M * Q K^T,  M[i, j] = e^{G_i - G_j} (j <= i)
    S_L   = e^{G_L} S0 + Kd^T U             Kd = e^{G_L - G} K

Everything that does not involve ``S0`` is computed for all chunks at once: ``U0, W`` (one
batched unit-lower-triangular solve), ``P``, and folded into

    O    = Qe S0 + P U0                    Qe = e^G Q - P W
    S_L  = F S0 + E                        F = e^{G_L} I - Kd^T W  [Dk, Dk],   E = Kd^T U0  [Dk, Dv]

so the only sequential part is ``S <- F_c S + E_c`` over the T/L chunks (one small batched matmul
per chunk, no host sync); the outputs are then one batched matmul against the stacked entry states.
All exponents are <= 0 (the cumulative log-decay only falls), so nothing overflows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.reference.formats.config import TargetConfig

from .rms_norm import GatedRMSNorm

L2NORM_EPS = 1e-6  # inside the sqrt, as the reference (and flash-linear-attention) use it


def l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           chunk_size: int = 64) -> Tensor:
    """The gated delta rule over whole sequences from a zero state, chunk by chunk (module docstring).

    Inputs as the reference rule takes them (the layer prepares them): q and k L2-normalised,
    q scaled by ``1/sqrt(Dk)``, both already repeated to the value heads. Layout token-major:
    q, k ``[N, T, H, Dk]``, v ``[N, T, H, Dv]``, g (log-decay <= 0), beta ``[N, T, H]``.
    Returns o ``[N, T, H, Dv]`` in fp32 (fp64 if the inputs are fp64: the dtype is promoted to at
    least fp32, and autocast is off inside, so bf16 inputs under autocast still compute in fp32).
    T need not be a multiple of ``chunk_size``: the tail is padded with g = 0, beta = 0, k = q = 0,
    which writes nothing and reads nothing.
    """
    n, steps, heads, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"chunk_gated_delta_rule shapes q {list(q.shape)} k {list(k.shape)} v {list(v.shape)} "
                         f"g {list(g.shape)} beta {list(beta.shape)}: expected q, k [N, T, H, Dk], "
                         "v [N, T, H, Dv], g, beta [N, T, H]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: expected a positive integer")
    dtype = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
        length = chunk_size
        pad = -steps % length
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
            g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
        chunks = (steps + pad) // length
        # head-major chunks inside: [N, H, nc, L, D] and [N, H, nc, L]
        q, k, v = (t.reshape(n, chunks, length, heads, -1).permute(0, 3, 1, 2, 4) for t in (q, k, v))
        g, beta = (t.reshape(n, chunks, length, heads).permute(0, 3, 1, 2) for t in (g, beta))

        cum = g.cumsum(dim=-1)  # G_i                                                   [N, H, nc, L]
        lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()  # j <= i
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # M
        a = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).tril(-1)  # A, strictly lower
        rhs = torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1)  # [B V | B e^G K]
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # diag of a unread
        u0, w = solved.split([dv, dk], dim=-1)  # [N, H, nc, L, Dv], [N, H, nc, L, Dk]

        p = decay * (q @ k.transpose(-1, -2))  # M * Q K^T                              [N, H, nc, L, L]
        qe = cum.exp()[..., None] * q - p @ w  # [N, H, nc, L, Dk]
        o_intra = p @ u0  # [N, H, nc, L, Dv]
        last = cum[..., -1:]  # G_L                                                     [N, H, nc, 1]
        kd_t = ((last - cum).exp()[..., None] * k).transpose(-1, -2)  # Kd^T           [N, H, nc, Dk, L]
        eye = torch.eye(dk, dtype=dtype, device=q.device)
        carry = last.exp()[..., None] * eye - kd_t @ w  # F                             [N, H, nc, Dk, Dk]
        inject = kd_t @ u0  # E                                                         [N, H, nc, Dk, Dv]

        state = q.new_zeros(n, heads, dk, dv)
        entry_states = []
        for c in range(chunks):
            entry_states.append(state)
            state = carry[:, :, c] @ state + inject[:, :, c]
        s0 = torch.stack(entry_states, dim=2)  # the state entering each chunk         [N, H, nc, Dk, Dv]
        o = qe @ s0 + o_intra  # [N, H, nc, L, Dv]
        return o.permute(0, 2, 3, 1, 4).reshape(n, chunks * length, heads, dv)[:, :steps]


class GatedDeltaNet(nn.Module):
    """The GDN token mixer; parameter names are the canonical ``linear_attn.*`` names.

    For the normalised input ``x [N, T, C]`` (reference/model/gdn.py, per token)::

        c = silu(causal_depthwise_conv(W_qkv x))       zero history before t = 0
        q, k, v = split(c);  q = l2norm(q)/sqrt(Dk);  k = l2norm(k)      key head i -> value heads i*r ..
        g = -exp(A_log) * softplus(W_a x + dt_bias);   beta = sigmoid(W_b x)
        y = W_out gated_rms_norm(delta_rule(q, k, v, g, beta), W_z x)
    """

    def __init__(self, cfg: TargetConfig, chunk_size: int = 64):
        super().__init__()
        c, hv = cfg.hidden_size, cfg.linear_num_value_heads
        self.cfg = cfg
        self.chunk_size = chunk_size
        self.in_proj_qkv = nn.utils.skip_init(nn.Linear, c, cfg.gdn_conv_dim, bias=False)
        self.in_proj_z = nn.utils.skip_init(nn.Linear, c, cfg.gdn_value_dim, bias=False)
        self.in_proj_b = nn.utils.skip_init(nn.Linear, c, hv, bias=False)
        self.in_proj_a = nn.utils.skip_init(nn.Linear, c, hv, bias=False)
        # weight [conv_dim, 1, K], as the canonical tensor; applied with left padding in forward
        self.conv1d = nn.utils.skip_init(nn.Conv1d, cfg.gdn_conv_dim, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim,
                                         groups=cfg.gdn_conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.utils.skip_init(nn.Linear, cfg.gdn_value_dim, c, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[N, T, C]`` (after input_layernorm). Returns ``[N, T, C]``."""
        cfg = self.cfg
        n, steps, _ = x.shape
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        kernel = cfg.linear_conv_kernel_dim

        conv_in = self.in_proj_qkv(x).transpose(1, 2)  # [N, conv_dim, T]
        # y_t = sum_j w_j c_{t-K+1+j}: cross-correlation over K-1 zeros of history, then the sequence
        conv_out = F.conv1d(F.pad(conv_in, (kernel - 1, 0)), self.conv1d.weight, groups=cfg.gdn_conv_dim)
        conv_out = F.silu(conv_out.transpose(1, 2))  # [N, T, conv_dim]
        q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
        q = l2norm(q.float().reshape(n, steps, hk, dk)) / dk ** 0.5  # [N, T, Hk, Dk]
        k = l2norm(k.float().reshape(n, steps, hk, dk))  # [N, T, Hk, Dk]
        v = v.reshape(n, steps, hv, dv)  # [N, T, Hv, Dv]
        q = q.repeat_interleave(hv // hk, dim=2)  # [N, T, Hv, Dk]
        k = k.repeat_interleave(hv // hk, dim=2)

        a = self.in_proj_a(x).float()  # [N, T, Hv]
        g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())  # [N, T, Hv] log-decay
        beta = torch.sigmoid(self.in_proj_b(x).float())  # [N, T, Hv]
        o = chunk_gated_delta_rule(q, k, v, g, beta, self.chunk_size)  # [N, T, Hv, Dv] fp32

        z = self.in_proj_z(x).reshape(n, steps, hv, dv)
        o = self.norm(o, z)  # [N, T, Hv, Dv]
        return self.out_proj(o.reshape(n, steps, hv * dv))  # [N, T, C]
