"""The two forms of the gated delta rule agree, and the GDN conv state carries across calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash2.reference.model.delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent
from dflash2.reference.model.gdn import causal_conv1d, l2norm
from hf_tiny import rms_rel_err


def _inputs(steps: int, heads: int = 3, dk: int = 5, dv: int = 7, seed: int = 0):
    """Random delta-rule inputs shaped as the layer hands them over (normalised q/k, g <= 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(steps, heads, dk, generator=gen)) / dk ** 0.5
    k = l2norm(torch.randn(steps, heads, dk, generator=gen))
    v = torch.randn(steps, heads, dv, generator=gen)
    g = -torch.rand(steps, heads, generator=gen) * 1.5  # decays from 1 down to e^-1.5
    beta = torch.sigmoid(torch.randn(steps, heads, generator=gen))
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("steps,chunk_size", [(1, 4), (4, 4), (11, 4), (13, 5), (13, 64), (20, 1)])
def test_chunked_equals_recurrent(steps, chunk_size):
    q, k, v, g, beta, state = _inputs(steps)
    o_loop, s_loop = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    o_chunk, s_chunk = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert o_loop.shape == o_chunk.shape == v.shape
    assert rms_rel_err(o_chunk, o_loop) < 1e-5
    assert rms_rel_err(s_chunk, s_loop) < 1e-5


def test_recurrent_splits_compose():
    """Running T tokens at once equals running them in two calls, passing the state between."""
    q, k, v, g, beta, state = _inputs(9)
    o_all, s_all = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    o_a, s_a = gated_delta_rule_recurrent(q[:4], k[:4], v[:4], g[:4], beta[:4], state)
    o_b, s_b = gated_delta_rule_recurrent(q[4:], k[4:], v[4:], g[4:], beta[4:], s_a)
    torch.testing.assert_close(torch.cat([o_a, o_b]), o_all)
    torch.testing.assert_close(s_b, s_all)


def test_one_step_by_hand():
    """A planted check of the update order: decay, then the delta write, then the read."""
    q, k, v, g, beta, state = _inputs(1, heads=1)
    decayed = torch.exp(g[0, 0]) * state[0]  # [Dk, Dv]
    u = beta[0, 0] * (v[0, 0] - decayed.T @ k[0, 0])
    new_state = decayed + torch.outer(k[0, 0], u)
    o, s = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(s[0], new_state)
    torch.testing.assert_close(o[0, 0], new_state.T @ q[0, 0])


def test_causal_conv_matches_padded_conv1d_and_carries_state():
    gen = torch.Generator().manual_seed(3)
    channels, kernel, steps = 6, 4, 9
    x = torch.randn(steps, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    expected = F.conv1d(x.T[None], weight[:, None, :], padding=kernel - 1, groups=channels)[0, :, :steps].T
    whole, state = causal_conv1d(x, torch.zeros(channels, kernel - 1), weight)
    torch.testing.assert_close(whole, expected)
    torch.testing.assert_close(state, x[-(kernel - 1):].T)
    pieces, state = [], torch.zeros(channels, kernel - 1)
    for piece in (x[:2], x[2:3], x[3:]):
        y, state = causal_conv1d(piece, state, weight)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces), whole)
