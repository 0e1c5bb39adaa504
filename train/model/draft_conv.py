"""The grouped dynamic causal conv around each draft sublayer, batched over blocks and trainable.

The twin of ``reference/model/conv.py``. One conv holds ``base_kernel [2, K, C]`` (side 0
prepares the sublayer input, side 1 finishes its output) and ``kernel_projection [2*K*C/G, C]``.
For the normalised sublayer input u of one block's B rows::

    delta_i = (W_kp u_i).reshape(2, K, C/G)                              [side, tap, group]
    prepare:  u'_i[c] = sum_{tau<K} (base[0, tau, c] + delta_i[0, tau, c // G]) * u_{i-tau}[c]
    finish:   y_i[c]  = sum_{tau<K} (base[1, tau, c] + delta_i[1, tau, c // G]) * o_{i-tau}[c]

with u_j = o_j = 0 for j < 0. The row axis is the block's own axis (``[..., B, C]``, any leading
axes), so no tap reaches another block or the context.

Identity start: ``base[:, 0] = 1``, ``base[:, 1:] = 0`` and ``W_kp = 0`` make prepare and finish
the identity, yet ``d y_i / d delta_i[side, tau, g] = sum_{c in g} x_{i-tau}[c]`` is not zero,
so ``W_kp`` still gets a gradient from its first step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import skip_init


class GroupedDynamicConv(nn.Module):
    """One sublayer's conv: ``base_kernel [2, K, C]`` and ``kernel_projection.weight [2*K*C/G, C]``."""

    def __init__(self, channels: int, num_taps: int, group_size: int):
        super().__init__()
        if channels % group_size:
            raise ValueError(f"conv_group_size={group_size}: expected a divisor of hidden_size={channels}")
        self.num_taps, self.group_size = num_taps, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, num_taps, channels))
        # values come from TrainableDraft.init_weights or a checkpoint, never from the global RNG
        self.kernel_projection = skip_init(nn.Linear, channels, 2 * num_taps * (channels // group_size), bias=False)

    def prepare(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """Side 0 on ``u [..., B, C]``: returns ``(u' [..., B, C], delta [..., B, 2, K, C/G])``."""
        delta = self.kernel_projection(u).unflatten(-1, (2, self.num_taps, -1))
        return self._side(u, 0, delta), delta

    def finish(self, o: Tensor, delta: Tensor) -> Tensor:
        """Side 1 on the sublayer output ``o [..., B, C]`` with prepare's ``delta``. Returns ``[..., B, C]``."""
        return self._side(o, 1, delta)

    def _side(self, x: Tensor, side: int, delta: Tensor) -> Tensor:
        rows = x.shape[-2]
        if self.num_taps > rows:
            raise ValueError(f"conv_kernel_size={self.num_taps}: expected at most the {rows} block rows")
        out = torch.zeros_like(x)
        for tau in range(self.num_taps):
            shifted = F.pad(x, (0, 0, tau, 0))[..., :rows, :]  # x_{i - tau}, zero where i < tau
            kernel = self.base_kernel[side, tau] + delta[..., side, tau, :].repeat_interleave(self.group_size, -1)
            out = out + kernel * shifted
        return out
