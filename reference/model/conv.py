"""The grouped dynamic causal convolution that wraps each DFlash 2 sublayer (attention and MLP).

One conv per sublayer holds ``base [2, K, C]`` (side 0 prepares the sublayer input, side 1
finishes its output; K taps) and ``W_kp [2*K*C/G, C]``. For the normalised sublayer input u of the
S block rows, the dynamic taps are one scalar per row, side, tap and group of G channels::

    delta_i = (W_kp u_i).reshape(2, K, C/G)              [side, tap, group]
    prepare:  u'_i[c] = sum_{tau<K} (base[0, tau, c] + delta_i[0, tau, c // G]) * u_{i-tau}[c]
    finish:   y_i[c]  = sum_{tau<K} (base[1, tau, c] + delta_i[1, tau, c // G]) * o_{i-tau}[c]

with u_j = o_j = 0 for j < 0: the conv runs over the block rows only, so no tap reaches the
context or crosses the block start. The layer then adds y to the residual stream. Both sides use
the delta computed from the sublayer *input* u (finish reuses prepare's side 1).

Checked against public sources: z-lab/dflash ``dflash/model_mlx.py`` (``GroupedDynamicCausalConv``:
``kernel_projection(hidden).reshape(..., 2, kernel_size, groups)``, side 0 in ``prepare``,
side 1 kept for ``finish``, taps shifted with zero fill at the block start) and vLLM
``qwen3_dflash2.py`` (``DFlashGroupedConv``: the same ``[T, 2, taps, num_groups]`` reshape, and
a tap mask ``position-in-block >= tap``); the tap order ``[side, tap, group]`` and the group of
channel c being ``c // G`` (channels ``[g*G, (g+1)*G)``) agree in both.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_taps(u: Tensor, kernel_projection: Tensor, num_taps: int) -> Tensor:
    """delta = W_kp u per row, as ``[S, 2, K, C/G]`` (side, tap, group).

    u: ``[S, C]``; kernel_projection: ``[2*K*C/G, C]``.
    """
    rows = u.shape[0]
    return (u @ kernel_projection.T).reshape(rows, 2, num_taps, -1)  # [S, 2, K, C/G]


def grouped_dynamic_conv(x: Tensor, base: Tensor, delta: Tensor, group_size: int) -> Tensor:
    """One side of the conv: ``y_i = sum_tau (base[tau] + expand_G(delta_i[tau])) * x_{i-tau}``.

    x: ``[S, C]`` block rows (row 0 is the block start); base: ``[K, C]`` (one side);
    delta: ``[S, K, C/G]`` (the same side). Returns ``[S, C]``. Written as a loop over taps.
    """
    rows, channels = x.shape
    num_taps = base.shape[0]
    out = torch.zeros_like(x)
    for tau in range(num_taps):
        if tau >= rows:
            break
        shifted = torch.zeros_like(x)  # x_{i - tau}, zero where i - tau < 0
        shifted[tau:] = x[: rows - tau]
        kernel = base[tau][None, :] + delta[:, tau].repeat_interleave(group_size, dim=-1)  # [S, C]
        out = out + kernel * shifted
    return out


def conv_prepare(u: Tensor, base: Tensor, kernel_projection: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Side 0 on the normalised sublayer input: returns ``(u' [S, C], delta [S, 2, K, C/G])``.

    base: ``[2, K, C]``; keep ``delta`` for :func:`conv_finish`.
    """
    delta = dynamic_taps(u, kernel_projection, base.shape[1])
    return grouped_dynamic_conv(u, base[0], delta[:, 0], group_size), delta


def conv_finish(o: Tensor, base: Tensor, delta: Tensor, group_size: int) -> Tensor:
    """Side 1 on the sublayer output ``o [S, C]``, with prepare's ``delta``. Returns ``[S, C]``."""
    return grouped_dynamic_conv(o, base[1], delta[:, 1], group_size)
