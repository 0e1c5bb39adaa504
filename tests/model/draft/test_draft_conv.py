"""The grouped dynamic conv against an explicit per-element formula; taps never cross the block start."""

from __future__ import annotations

import pytest
import torch

from dflash2.reference.model.conv import conv_finish, conv_prepare


def per_element(x, u, base_side, w_kp, side, num_taps, group_size):
    """y[i, c] = sum_tau (base[tau, c] + (W_kp u_i)[side*K*Gn + tau*Gn + c // G]) * x[i - tau, c], x[<0] = 0."""
    rows, channels = x.shape
    groups = channels // group_size
    y = torch.zeros(rows, channels, dtype=torch.float64)
    for i in range(rows):
        proj = w_kp.double() @ u[i].double()  # [2*K*Gn] in (side, tap, group) order
        for c in range(channels):
            for tau in range(num_taps):
                if i - tau < 0:
                    continue
                dyn = proj[side * num_taps * groups + tau * groups + c // group_size]
                y[i, c] += (base_side[tau, c].double() + dyn) * x[i - tau, c].double()
    return y


@pytest.mark.parametrize("rows, channels, num_taps, group_size", [(4, 12, 2, 4), (5, 12, 3, 3), (8, 16, 2, 16)])
def test_prepare_and_finish_match_the_formula(rows, channels, num_taps, group_size):
    gen = torch.Generator().manual_seed(rows * channels + num_taps)
    u = torch.randn(rows, channels, generator=gen)
    o = torch.randn(rows, channels, generator=gen)
    base = torch.randn(2, num_taps, channels, generator=gen)
    w_kp = torch.randn(2 * num_taps * channels // group_size, channels, generator=gen)
    prepared, delta = conv_prepare(u, base, w_kp, group_size)
    finished = conv_finish(o, base, delta, group_size)
    torch.testing.assert_close(prepared.double(), per_element(u, u, base[0], w_kp, 0, num_taps, group_size),
                               rtol=1e-5, atol=1e-5)
    # finish convolves the sublayer output o with taps computed from the sublayer input u
    torch.testing.assert_close(finished.double(), per_element(o, u, base[1], w_kp, 1, num_taps, group_size),
                               rtol=1e-5, atol=1e-5)


def test_taps_never_cross_the_block_start():
    gen = torch.Generator().manual_seed(0)
    rows, channels, group_size = 6, 8, 4
    base = torch.randn(2, 2, channels, generator=gen)
    o = torch.randn(rows, channels, generator=gen)
    delta = torch.zeros(rows, 2, 2, channels // group_size)  # static taps: row i reads rows i and i-1 only
    y = conv_finish(o, base, delta, group_size)
    torch.testing.assert_close(y[0], base[1, 0] * o[0])  # row 0: tap 1 would reach before the block: zero
    changed = o.clone()
    changed[3] += 1.0
    diff = (conv_finish(changed, base, delta, group_size) - y).abs().sum(-1)
    assert diff[:3].eq(0).all() and diff[3:5].gt(0).all() and diff[5:].eq(0).all()


def test_more_taps_than_rows_reads_nothing_before_the_block():
    u = torch.randn(2, 4)
    base = torch.ones(2, 3, 4)
    w_kp = torch.zeros(2 * 3 * 1, 4)
    prepared, _ = conv_prepare(u, base, w_kp, 4)
    torch.testing.assert_close(prepared, torch.stack([u[0], u[0] + u[1]]))
