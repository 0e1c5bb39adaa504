"""The draft forward: context rows, the symmetric window, non-causality inside the block, RoPE."""

from __future__ import annotations

import pytest
import torch

from dflash2.reference.model.draft import ReferenceDraft, qwen3_rms_norm, window_attention


def context(draft: ReferenceDraft, anchor_position: int, seed: int = 0, first: int = 0):
    """Random context rows at positions first .. s-1 and their K/V ([L, N, Hkv, D])."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(first, anchor_position)
    rows = torch.randn(len(positions), draft.cfg.hidden_size, generator=gen)
    k, v = draft.context_kv(rows, positions)
    return rows, positions, k, v


def test_block_shapes_and_logits(draft):
    cfg = draft.cfg
    _, positions, k, v = context(draft, 20)
    out = draft.forward_block(5, 20, positions, k, v)
    assert out.hidden.shape == (cfg.block_size, cfg.hidden_size)
    assert out.logits.shape == (cfg.block_size - 1, cfg.vocab_size)
    assert torch.isfinite(out.hidden).all()
    torch.testing.assert_close(out.logits, out.hidden[1:] @ draft.lm_head.T)
    assert draft.block_tokens(5).tolist() == [5] + [cfg.mask_token_id] * (cfg.block_size - 1)


def test_context_rows_are_fc_then_plain_rmsnorm(draft, target_cfg):
    cfg = draft.cfg
    gen = torch.Generator().manual_seed(3)
    taps = tuple(torch.randn(5, cfg.hidden_size, generator=gen) for _ in range(target_cfg.num_hidden_layers))
    rows = draft.context_rows(taps)
    features = torch.cat([taps[i] for i in cfg.target_layer_ids], dim=-1)
    projected = features @ draft.w["fc.weight"].T
    expected = projected / projected.pow(2).mean(-1, keepdim=True).add(cfg.rms_norm_eps).sqrt()
    torch.testing.assert_close(rows, expected * draft.w["hidden_norm.weight"])  # w * x, not (1 + w) * x
    with pytest.raises(ValueError, match="target layer outputs"):
        draft.context_rows(taps[:-1])


def test_context_row_outside_a_rows_window_is_never_read(draft):
    """Row i sees context positions s+i-W+1 .. s-1: NaN anywhere older leaves row i exact."""
    cfg = draft.cfg
    gen = torch.Generator().manual_seed(1)
    s, n, heads, hkv, d, w = 12, 12, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window
    positions = s + torch.arange(cfg.block_size)
    ctx_positions = torch.arange(s - n, s)
    q = torch.randn(cfg.block_size, heads, d, generator=gen)
    bk, bv = torch.randn(2, cfg.block_size, hkv, d, generator=gen)
    ck, cv = torch.randn(2, n, hkv, d, generator=gen)
    clean = window_attention(q, positions, bk, bv, ck, cv, ctx_positions, w)
    for i in range(cfg.block_size):
        outside = ctx_positions <= s + i - w  # distance >= W
        poisoned_k, poisoned_v = ck.clone(), cv.clone()
        poisoned_k[outside], poisoned_v[outside] = float("nan"), float("nan")
        out = window_attention(q, positions, bk, bv, poisoned_k, poisoned_v, ctx_positions, w)
        assert torch.equal(out[i], clean[i])
        # the oldest row inside the window (distance W-1) is read
        inside = ctx_positions == s + i - w + 1
        nudged = cv.clone()
        nudged[inside] += 1.0
        assert not torch.equal(window_attention(q, positions, bk, bv, ck, nudged, ctx_positions, w)[i], clean[i])


def test_window_gather_equals_a_dense_masked_softmax(draft):
    cfg = draft.cfg
    gen = torch.Generator().manual_seed(2)
    s, heads, hkv, d, w = 10, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window
    positions = s + torch.arange(cfg.block_size)
    ctx_positions = torch.arange(s)
    q = torch.randn(cfg.block_size, heads, d, generator=gen)
    bk, bv = torch.randn(2, cfg.block_size, hkv, d, generator=gen)
    ck, cv = torch.randn(2, s, hkv, d, generator=gen)
    keys = torch.cat([ck, bk]).repeat_interleave(heads // hkv, dim=1)
    values = torch.cat([cv, bv]).repeat_interleave(heads // hkv, dim=1)
    key_pos = torch.cat([ctx_positions, positions])
    scores = torch.einsum("shd,nhd->hsn", q, keys) / d ** 0.5
    visible = (positions[:, None] - key_pos[None, :]).abs() < w  # [S, N+S]
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    dense = torch.einsum("hsn,nhd->shd", weights, values)
    torch.testing.assert_close(window_attention(q, positions, bk, bv, ck, cv, ctx_positions, w), dense)


def test_block_is_non_causal_inside(draft):
    cfg = draft.cfg
    gen = torch.Generator().manual_seed(4)
    positions = 7 + torch.arange(cfg.block_size)
    q = torch.randn(cfg.block_size, cfg.num_attention_heads, cfg.head_dim, generator=gen)
    bk, bv = torch.randn(2, cfg.block_size, cfg.num_key_value_heads, cfg.head_dim, generator=gen)
    empty = torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim)
    clean = window_attention(q, positions, bk, bv, empty, empty, torch.zeros(0, dtype=torch.long), cfg.sliding_window)
    later = bv.clone()
    later[3] += 1.0
    out = window_attention(q, positions, bk, later, empty, empty, torch.zeros(0, dtype=torch.long), cfg.sliding_window)
    assert not torch.equal(out[1], clean[1]) and not torch.equal(out[0], clean[0])


def test_row_zero_sees_the_mask_rows(draft, target_weights):
    """Whole forward: row 0 changes with the mask embedding, which only rows 1.. carry (the conv is
    causal, so only non-causal attention can carry it back)."""
    _, positions, k, v = context(draft, 9)
    clean = draft.forward_block(5, 9, positions, k, v).hidden
    weights = dict(target_weights)
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"].clone()
    weights["embed_tokens.weight"][draft.cfg.mask_token_id] += 0.5
    other = ReferenceDraft(draft.cfg, draft.w, weights).forward_block(5, 9, positions, k, v).hidden
    assert not torch.allclose(other[0], clean[0])


def test_forward_never_depends_on_rows_outside_every_window(draft):
    cfg = draft.cfg
    s, w = 20, cfg.sliding_window
    _, positions, k, v = context(draft, s)
    clean = draft.forward_block(3, s, positions, k, v).hidden
    stale = positions <= s - w  # outside even row 0's window
    pk, pv = k.clone(), v.clone()
    pk[:, stale], pv[:, stale] = float("nan"), float("nan")
    assert torch.equal(draft.forward_block(3, s, positions, pk, pv).hidden, clean)
    # passing only the readable rows s-W+1 .. s-1 is the same forward
    readable = ~stale
    assert torch.equal(draft.forward_block(3, s, positions[readable], k[:, readable], v[:, readable]).hidden, clean)
    nudged = v.clone()
    nudged[:, positions == s - w + 1] += 1.0  # row 0's oldest visible row
    assert not torch.equal(draft.forward_block(3, s, positions, k, nudged).hidden, clean)


def test_context_at_or_after_the_anchor_is_refused(draft):
    _, positions, k, v = context(draft, 10)
    with pytest.raises(ValueError, match="not before the anchor"):
        draft.forward_block(3, 9, positions, k, v)


def test_rope_sees_only_relative_positions(draft):
    """Block queries and context keys both turn at absolute positions: a common shift cancels."""
    rows, positions, k, v = context(draft, 7)
    base = draft.forward_block(11, 7, positions, k, v).hidden
    k2, v2 = draft.context_kv(rows, positions + 300)
    shifted = draft.forward_block(11, 307, positions + 300, k2, v2).hidden
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-4)


def test_qwen3_norm_is_w_times_x():
    x = torch.tensor([[3.0, 4.0]])
    y = qwen3_rms_norm(x, torch.tensor([2.0, 0.0]), 0.0)
    torch.testing.assert_close(y, torch.tensor([[2 * 3 / 12.5 ** 0.5, 0.0]]))


def _rope_rotate_half(x, positions, theta):
    """NeoX RoPE over the whole head, in the rotate_half form: x cos + rotate_half(x) sin."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None, :], torch.cat([angles.sin()] * 2, -1)[:, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def dense_forward(draft, anchor, s, ctx_rows, ctx_positions):
    """A second form of the whole forward in fp64, from the facts sheet: own norm, RoPE and conv, the
    context K/V computed inline from the rows, and one dense masked softmax over [context, block]."""
    cfg, w = draft.cfg, {n: t.double() for n, t in draft.w.items()}
    eps, S, H, Hkv, D, G = cfg.rms_norm_eps, cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.head_dim, cfg.conv_group_size

    def norm(x, weight):
        return weight * x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()

    def conv(x, base_side, taps):  # taps [S, K, C/G]
        y = torch.zeros_like(x)
        for i in range(S):
            for tau in range(cfg.conv_kernel_size):
                if i - tau >= 0:
                    y[i] += (base_side[tau] + taps[i, tau].repeat_interleave(G)) * x[i - tau]
        return y

    positions = s + torch.arange(S)
    key_positions = torch.cat([ctx_positions, positions])
    mask = (positions[:, None] - key_positions[None, :]).abs() < cfg.sliding_window  # context rows are < s
    x = draft.embed.double()[[anchor] + [cfg.mask_token_id] * (S - 1)]
    rows = ctx_rows.double()
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        for sub in ("attn", "mlp"):
            conv_name = "attention_conv" if sub == "attn" else "mlp_conv"
            u = norm(x, w[p + ("input_layernorm" if sub == "attn" else "post_attention_layernorm") + ".weight"])
            taps = (u @ w[p + conv_name + ".kernel_projection.weight"].T).reshape(S, 2, cfg.conv_kernel_size, -1)
            base = w[p + conv_name + ".base_kernel"]
            u = conv(u, base[0], taps[:, 0])
            if sub == "attn":
                a = p + "self_attn."
                q = _rope_rotate_half(norm((u @ w[a + "q_proj.weight"].T).view(S, H, D), w[a + "q_norm.weight"]),
                                      positions, cfg.rope_theta)
                src = torch.cat([rows, u])  # context rows get no input norm and no conv
                k = _rope_rotate_half(norm((src @ w[a + "k_proj.weight"].T).view(-1, Hkv, D), w[a + "k_norm.weight"]),
                                      key_positions, cfg.rope_theta).repeat_interleave(H // Hkv, 1)
                v = (src @ w[a + "v_proj.weight"].T).view(-1, Hkv, D).repeat_interleave(H // Hkv, 1)
                scores = torch.einsum("shd,nhd->hsn", q, k) / D ** 0.5
                attn = torch.einsum("hsn,nhd->shd", torch.softmax(scores.masked_fill(~mask, -torch.inf), -1), v)
                out = attn.reshape(S, H * D) @ w[a + "o_proj.weight"].T
            else:
                m = p + "mlp."
                out = (torch.nn.functional.silu(u @ w[m + "gate_proj.weight"].T) * (u @ w[m + "up_proj.weight"].T)) \
                    @ w[m + "down_proj.weight"].T
            x = x + conv(out, base[1], taps[:, 1])
    return norm(x, w["norm.weight"])


@pytest.mark.parametrize("anchor_position, first", [(6, 0), (13, 0), (13, 9)])
def test_forward_equals_a_dense_fp64_second_form(draft, anchor_position, first):
    rows, positions, k, v = context(draft, anchor_position, seed=anchor_position, first=first)
    out = draft.forward_block(17, anchor_position, positions, k, v)
    expected = dense_forward(draft, 17, anchor_position, rows, positions)
    torch.testing.assert_close(out.hidden.double(), expected, rtol=2e-4, atol=2e-4)
