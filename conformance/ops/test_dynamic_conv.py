"""fast/kernels/draft/dynamic_conv.py (the Triton launcher and the batched torch twin) vs
reference/model/conv.grouped_dynamic_conv, block by block: NUMERIC (fp32 1e-5, bf16 2e-2).

Shapes: the draft's K = 2, G = 16 over B = 3 blocks of 8 rows; K = 3 with G = 4 and C/G = 5 groups
(C = 20, padded to 32 in the kernel); more taps than rows (K = 4, S = 3). x is a view into a
NaN-poisoned buffer (row stride wider than C), delta one side of a ``[B, S, 2, K, C/G]`` tensor,
read in place. With a residual, ``r + y`` against ``r + reference``. The Triton launcher is held to
the torch twin too. Planted bug: one conv over all B*S rows (taps crossing block starts) must fail.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.draft.dynamic_conv import grouped_dynamic_conv_torch, grouped_dynamic_conv_triton
from dflash2.reference.model.conv import grouped_dynamic_conv

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(3, 8, 64, 16, 2), (2, 5, 20, 4, 3), (2, 3, 12, 4, 4)]  # B, S, C, G, K


def make_inputs(batch: int, rows: int, channels: int, group: int, taps: int, side: int, device: str,
                dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((batch * rows, channels + 7), float("nan"))
    buf[:, 3:3 + channels] = torch.randn(batch * rows, channels, generator=gen)
    x = buf.to(device, dtype)[:, 3:3 + channels].view(batch, rows, channels)  # row stride C + 7
    base = (torch.randn(2, taps, channels, generator=gen) * 0.5).to(device, dtype)
    delta_all = (torch.randn(batch, rows, 2, taps, channels // group, generator=gen) * 0.2).to(device, dtype)
    residual = torch.randn(batch, rows, channels, generator=gen).to(device, dtype)
    return x, base[side], delta_all[:, :, side], residual


def reference(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    x, base, delta = x.float().cpu(), base.float().cpu(), delta.float().cpu()
    return torch.stack([grouped_dynamic_conv(x[b], base, delta[b], group) for b in range(x.shape[0])])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-S{s[1]}-C{s[2]}-G{s[3]}-K{s[4]}")
def test_grouped_dynamic_conv_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    batch, rows, channels, group, taps = shape
    fn = pick(impl, grouped_dynamic_conv_torch, grouped_dynamic_conv_triton)
    for side in (0, 1):
        for dtype in DTYPES:
            x, base, delta, residual = make_inputs(*shape, side, device, dtype, seed=sum(shape) + side)
            expected = reference(x, base, delta, group)
            name = f"{str(dtype)[6:]}/side{side}"
            y = fn(x, base, delta, group)
            assert y.dtype == dtype and y.shape == x.shape
            report.numeric(f"conv/{name}", y, expected, NUMERIC_BOUND[dtype])
            h = fn(x, base, delta, group, residual)
            report.numeric(f"conv+r/{name}", h, residual.float().cpu() + expected, NUMERIC_BOUND[dtype])
            if impl == "triton":
                report.numeric(f"twin/{name}", h, grouped_dynamic_conv_torch(x, base, delta, group, residual),
                               NUMERIC_BOUND[dtype])


def test_grouped_dynamic_conv_refusals():
    x, base, delta, residual = make_inputs(2, 4, 16, 4, 2, 0, "cpu", torch.float32, seed=0)
    with pytest.raises(ValueError, match="group_size"):
        grouped_dynamic_conv_triton(x, base, delta, 5)
    with pytest.raises(ValueError, match="delta"):
        grouped_dynamic_conv_triton(x, base, delta[:, :, :1], 4)
    with pytest.raises(ValueError, match="residual"):
        grouped_dynamic_conv_triton(x, base, delta, 4, residual[:1])


def test_planted_bug_taps_across_block_starts_are_caught(impl_device, report):
    impl, device = impl_device
    x, base, delta, _ = make_inputs(3, 8, 64, 16, 2, 0, device, torch.float32, seed=9)
    fn = pick(impl, grouped_dynamic_conv_torch, grouped_dynamic_conv_triton)
    crossing = fn(x.reshape(1, 24, 64), base, delta.reshape(1, 24, 2, 4), 16).reshape(3, 8, 64)  # one long block
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("conv/float32", crossing, reference(x, base, delta, 16), NUMERIC_BOUND[torch.float32])
