"""The gated delta rule: the recurrence inside a Gated DeltaNet layer, in two equivalent forms.

Per value head, with a state ``S`` of shape ``[Dk, Dv]`` (a map from keys to values), each token
``t`` with query ``q_t`` and key ``k_t`` (``[Dk]``), value ``v_t`` (``[Dv]``), log-decay
``g_t <= 0`` and write strength ``beta_t`` in ``(0, 1)`` does::

    S'_t = exp(g_t) * S_{t-1}                      decay the memory
    u_t  = beta_t * (v_t - S'_t^T k_t)             the correction: what S'_t mispredicts for k_t
    S_t  = S'_t + k_t u_t^T                        write it back (the delta rule)
    o_t  = S_t^T q_t                               read with the query

Both forms take the inputs exactly as the layer hands them over: q and k already L2-normalised,
q already scaled by ``1/sqrt(Dk)``, and q, k already repeated to the value heads. Shapes:
q, k ``[T, Hv, Dk]``, v ``[T, Hv, Dv]``, g, beta ``[T, Hv]``, state ``[Hv, Dk, Dv]``. Everything
runs in fp32. Each function returns ``(o [T, Hv, Dv], final state [Hv, Dk, Dv])``.

:func:`gated_delta_rule_recurrent` is the definition, a loop over time.
:func:`gated_delta_rule_chunked` computes the same numbers a chunk of ``L`` tokens at a time with
matrix products, the way the fast kernels do (derivation in its docstring).
"""

from __future__ import annotations

import torch
from torch import Tensor


def gated_delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule as a plain loop over time (see the module docstring)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float().clone()  # [Hv, Dk, Dv]
    outputs = []
    for t in range(q.shape[0]):
        s = torch.exp(g[t])[:, None, None] * s  # S'_t
        predicted = torch.einsum("hkv,hk->hv", s, k[t])  # S'_t^T k_t        [Hv, Dv]
        u = beta[t][:, None] * (v[t] - predicted)  # u_t                       [Hv, Dv]
        s = s + k[t][:, :, None] * u[:, None, :]  # S_t = S'_t + k_t u_t^T    [Hv, Dk, Dv]
        outputs.append(torch.einsum("hkv,hk->hv", s, q[t]))  # o_t = S_t^T q_t
    return torch.stack(outputs, dim=0), s


def _solve_unit_lower(a: Tensor, rhs: Tensor) -> Tensor:
    """Solve ``(I + a) x = rhs`` for a strictly lower-triangular ``a`` ``[Hv, L, L]``."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype).expand_as(a)
    return torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)


def gated_delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                             chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The gated delta rule computed chunk by chunk; equal to the loop up to rounding.

    Inside a chunk of L tokens that starts from the state ``S0``, let ``G_i = g_1 + ... + g_i``
    (cumulative log-decay, 1-based within the chunk). Unrolling the loop gives::

        S'_i = e^{G_i} S0 + sum_{j<i}  e^{G_i - G_j} k_j u_j^T
        S_i  = e^{G_i} S0 + sum_{j<=i} e^{G_i - G_j} k_j u_j^T

    Substituting ``S'_i`` into ``u_i = beta_i (v_i - S'_i^T k_i)``::

        u_i + sum_{j<i} beta_i e^{G_i - G_j} (k_i . k_j) u_j = beta_i v_i - beta_i e^{G_i} S0^T k_i

    which is the unit lower-triangular system ``(I + A) U = B V - (B e^G K) S0`` with
    ``A[i, j] = beta_i e^{G_i - G_j} (k_i . k_j)`` for ``j < i`` and ``B = diag(beta)``. Solving it
    gives every correction of the chunk at once. Then the outputs and the carried state are::

        O     = (e^G Q) S0 + (M * Q K^T) U         M[i, j] = e^{G_i - G_j} for j <= i, else 0
        S_L   = e^{G_L} S0 + (e^{G_L - G} K)^T U

    All decay factors are ``e^{x}`` with ``x <= 0``, so nothing overflows.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float().clone()  # [Hv, Dk, Dv]
    # head-major inside this function: [Hv, T, D]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)  # [Hv, T]
    outputs = []
    for start in range(0, q.shape[1], chunk_size):
        span = slice(start, start + chunk_size)
        qc, kc, vc, gc, bc = q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span]
        length = qc.shape[1]
        cum = gc.cumsum(dim=1)  # G_i                                               [Hv, L]
        diff = cum[:, :, None] - cum[:, None, :]  # G_i - G_j                       [Hv, L, L]
        lower = torch.ones(length, length, dtype=torch.bool).tril()  # j <= i
        strictly_lower = lower.tril(-1)  # j < i
        decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # M

        kk = kc @ kc.transpose(1, 2)  # k_i . k_j                                   [Hv, L, L]
        a = torch.where(strictly_lower, bc[:, :, None] * decay * kk, torch.zeros_like(kk))
        rhs_v = bc[:, :, None] * vc  # B V                                          [Hv, L, Dv]
        rhs_k = (bc * cum.exp())[:, :, None] * kc  # B e^G K                        [Hv, L, Dk]
        u = _solve_unit_lower(a, rhs_v) - _solve_unit_lower(a, rhs_k) @ s  # U      [Hv, L, Dv]

        qk = decay * (qc @ kc.transpose(1, 2))  # M * Q K^T                          [Hv, L, L]
        outputs.append((cum.exp()[:, :, None] * qc) @ s + qk @ u)  # O              [Hv, L, Dv]
        last = cum[:, -1:]  # G_L                                                    [Hv, 1]
        s = last.exp()[:, :, None] * s + ((last - cum).exp()[:, :, None] * kc).transpose(1, 2) @ u
    return torch.cat(outputs, dim=1).transpose(0, 1), s
