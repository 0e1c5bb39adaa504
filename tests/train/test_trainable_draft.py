"""TrainableDraft against the reference draft: batched forward, selector scores, weights, gradients."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash2.reference.formats.draft_checkpoint import expected_draft_shapes, load_draft
from dflash2.reference.formats.draft_config import parse_draft_config
from dflash2.reference.formats.errors import CheckpointError
from dflash2.reference.model.draft import ReferenceDraft
from dflash2.reference.speculative.selector import CandidateSelector, edge_scores, select, top_candidates
from dflash2.reference.tiny.draft import init_draft_tensor, tiny_draft_config
from dflash2.reference.tiny.target import tiny_target_config
from dflash2.train.model.draft import TrainableDraft, block_attention_mask

TARGET = tiny_target_config("tiny-dense")  # C=40, V=512, 6 layers
T, ANCHORS = 40, torch.tensor([[1, 17, 32], [32, 9, 1]])  # s = 1 and s = T - B in both sequences


def draft_config(**overrides):
    return parse_draft_config(tiny_draft_config(TARGET, **overrides), TARGET)


def reference_weights(cfg, seed: int = 7) -> dict[str, torch.Tensor]:
    """Non-degenerate random draft weights (the tiny factory's init: conv near identity, not at it)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: init_draft_tensor(name, shape, gen) for name, shape in expected_draft_shapes(cfg).items()}


def target_tables(cfg, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) / cfg.hidden_size ** 0.5
            for name in ("embed_tokens.weight", "lm_head.weight")}


def batch(cfg, ref: ReferenceDraft, seed: int = 0):
    """Per-layer taps [N][L_target] of [T, C], the features F [N, T, m*C], anchor tokens, block embeddings."""
    gen = torch.Generator().manual_seed(seed)
    n, a = ANCHORS.shape
    taps = [[torch.randn(T, cfg.hidden_size, generator=gen) for _ in range(cfg.num_target_layers)] for _ in range(n)]
    features = torch.stack([torch.cat([seq[i] for i in cfg.target_layer_ids], dim=-1) for seq in taps])
    tokens = torch.randint(0, cfg.vocab_size - 1, (n, a), generator=gen)
    embeds = torch.stack([torch.stack([ref.embed[ref.block_tokens(int(t))] for t in row]) for row in tokens])
    return taps, features, tokens, embeds  # embeds [N, A, B, C]


def reference_hidden(ref: ReferenceDraft, taps, tokens) -> torch.Tensor:
    """context_rows -> context_kv -> forward_block per (sequence, anchor), ctx positions 0 .. s-1."""
    out = []
    for n, seq in enumerate(taps):
        k, v = ref.context_kv(ref.context_rows(seq), torch.arange(T))  # [L, T, Hkv, D]
        out.append(torch.stack([ref.forward_block(int(tok), int(s), torch.arange(s), k[:, :s], v[:, :s]).hidden
                                for s, tok in zip(ANCHORS[n], tokens[n])]))
    return torch.stack(out)  # [N, A, B, C]


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 16, "conv_kernel_size": 3}],
                         ids=["all-context", "window-cuts-context"])
def test_forward_equals_the_reference_per_anchor(overrides):
    cfg = draft_config(**overrides)
    weights = reference_weights(cfg)
    ref = ReferenceDraft(cfg, weights, target_tables(cfg))
    taps, features, tokens, embeds = batch(cfg, ref)
    hidden = TrainableDraft.from_canonical(cfg, weights)(features, ANCHORS, embeds)
    expected = reference_hidden(ref, taps, tokens)
    assert hidden.shape == expected.shape == (2, 3, cfg.block_size, cfg.hidden_size)
    assert (hidden - expected).abs().max() < 2e-5


def test_the_window_case_is_not_vacuous():
    """With W=16 < T the anchor at s=32 loses context rows, so its hidden must change; s=1 must not."""
    wide, narrow = draft_config(), draft_config(sliding_window=16)
    weights = reference_weights(wide)
    ref = ReferenceDraft(wide, weights, target_tables(wide))
    _, features, _, embeds = batch(wide, ref)
    h_wide = TrainableDraft.from_canonical(wide, weights)(features, ANCHORS, embeds)
    h_narrow = TrainableDraft.from_canonical(narrow, weights)(features, ANCHORS, embeds)
    assert not torch.allclose(h_wide[0, 2], h_narrow[0, 2])  # s = 32
    torch.testing.assert_close(h_wide[0, 0], h_narrow[0, 0], rtol=0, atol=1e-6)  # s = 1: one context row


def test_mask_rows_read_their_window_and_their_own_block_only():
    mask = block_attention_mask(torch.tensor([[3, 10]]), num_ctx=14, block_size=2, window=4)[0, 0]
    assert mask.shape == (4, 14 + 4)
    # row 1 of the block at s=10 (position 11): context p < 10 with 11 - p < 4, i.e. p = 8, 9
    assert mask[3, :14].nonzero().flatten().tolist() == [8, 9]
    assert mask[0, :14].nonzero().flatten().tolist() == [0, 1, 2]  # position 3: p = 0 .. 2
    assert mask[:, 14:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


def test_selector_scores_equal_the_reference_walk_and_edge_scores():
    cfg = draft_config()
    weights = reference_weights(cfg)
    ref = ReferenceDraft(cfg, weights, target_tables(cfg))
    draft = TrainableDraft.from_canonical(cfg, weights)
    selector = CandidateSelector.from_draft(cfg, weights)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(12, cfg.hidden_size, generator=gen)
    k, v = ref.context_kv(rows, torch.arange(12))
    block = ref.forward_block(4, 12, torch.arange(12), k, v)
    walk = select(block, selector, 4, cfg.block_size - 1, temperature=0.0)
    unary = torch.stack([top_candidates(z, cfg.selector_top_k)[1] for z in block.logits])  # [B-1, K]
    prev = torch.cat([torch.tensor([4]), walk.tokens[:-1]])  # y_0 = t0, then the walk
    scores = draft.selector_scores(block.hidden[1:], walk.cand_ids, unary, prev)
    torch.testing.assert_close(scores, walk.sigma, rtol=0, atol=1e-5)

    hidden = torch.randn(2, 3, cfg.hidden_size, generator=gen)
    cand_ids = torch.randint(0, cfg.vocab_size, (2, 3, cfg.selector_top_k), generator=gen)
    cand_logits = torch.randn(2, 3, cfg.selector_top_k, generator=gen)
    prev_ids = torch.randint(0, cfg.vocab_size, (2, 3), generator=gen)
    batched = draft.selector_scores(hidden, cand_ids, cand_logits, prev_ids)
    for i in range(2):
        for j in range(3):
            g = hidden[i, j] @ selector.hidden_projection.T
            expected = edge_scores(selector, int(prev_ids[i, j]), g, cand_ids[i, j], cand_logits[i, j])
            torch.testing.assert_close(batched[i, j], expected, rtol=0, atol=1e-5)


def test_canonical_state_dict_is_the_checkpoint_layout_and_round_trips(tmp_path):
    cfg = draft_config()
    draft = TrainableDraft(cfg)
    draft.init_weights(1)
    state = draft.canonical_state_dict()
    expected = expected_draft_shapes(cfg)
    assert list(state) == list(expected)
    assert {name: tuple(t.shape) for name, t in state.items()} == expected
    again = TrainableDraft.from_canonical(cfg, state).canonical_state_dict()
    assert all(torch.equal(again[name], state[name]) for name in state)
    # the real loader accepts it unchanged
    (tmp_path / "config.json").write_text(json.dumps(tiny_draft_config(TARGET)))
    save_file({n: t.contiguous() for n, t in state.items()}, str(tmp_path / "model.safetensors"))
    _, loaded = load_draft(tmp_path, TARGET)
    assert all(torch.equal(loaded[name], state[name]) for name in state)


@pytest.mark.parametrize("edit, match", [
    (lambda w: w.pop("norm.weight"), "missing"),
    (lambda w: w.update({"embed_tokens.weight": torch.zeros(512, 40)}), "unexpected"),
    (lambda w: w.update({"fc.weight": torch.zeros(40, 40)}), "'fc.weight' has shape"),
])
def test_from_canonical_refuses_a_wrong_table(edit, match):
    cfg = draft_config()
    weights = reference_weights(cfg)
    edit(weights)
    with pytest.raises(CheckpointError, match=match):
        TrainableDraft.from_canonical(cfg, weights)


def test_gradients_reach_every_parameter_from_the_training_init():
    """Identity conv and zero kernel_projection at init, yet every gradient is non-zero."""
    cfg = draft_config()
    draft = TrainableDraft(cfg)
    draft.init_weights(0)
    gen = torch.Generator().manual_seed(9)
    features = torch.randn(2, T, cfg.num_taps * cfg.hidden_size, generator=gen)
    embeds = torch.randn(2, 3, cfg.block_size, cfg.hidden_size, generator=gen)
    hidden = draft(features, ANCHORS, embeds)  # [N, A, B, C]
    k = cfg.selector_top_k
    cand_ids = torch.randint(0, cfg.vocab_size, (2, 3, cfg.block_size - 1, k), generator=gen)
    prev_ids = torch.randint(0, cfg.vocab_size, (2, 3, cfg.block_size - 1), generator=gen)
    scores = draft.selector_scores(hidden[:, :, 1:], cand_ids, torch.randn(cand_ids.shape, generator=gen), prev_ids)
    loss = (hidden * torch.randn(hidden.shape, generator=gen)).sum() + (scores * torch.randn(scores.shape,
                                                                                          generator=gen)).sum()
    loss.backward()
    dead = [name for name, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []


def test_init_is_deterministic_and_shaped_as_asked():
    cfg = draft_config()
    a, b = TrainableDraft(cfg), TrainableDraft(cfg)
    a.init_weights(4)
    b.init_weights(4)
    sa, sb = a.canonical_state_dict(), b.canonical_state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    b.init_weights(5)
    assert not torch.equal(sa["fc.weight"], b.canonical_state_dict()["fc.weight"])

    conv = a.layers[0].attention_conv
    assert torch.equal(sa["layers.1.mlp_conv.kernel_projection.weight"], torch.zeros_like(
        sa["layers.1.mlp_conv.kernel_projection.weight"]))
    u = torch.randn(3, cfg.block_size, cfg.hidden_size)
    prepared, delta = conv.prepare(u)
    assert torch.equal(prepared, u) and torch.equal(conv.finish(u, delta), u)  # identity both sides
    assert all(torch.equal(t, torch.ones_like(t)) for n, t in sa.items() if n.endswith("norm.weight"))
    residual = 0.02 / (2 * cfg.num_hidden_layers) ** 0.5
    for name, std in (("fc.weight", 0.02), ("candidate_selector.predecessor_codebook", 0.02),
                      ("candidate_selector.hidden_projection.weight", 0.02),
                      ("layers.0.self_attn.o_proj.weight", residual), ("layers.1.mlp.down_proj.weight", residual)):
        assert abs(float(sa[name].std()) / std - 1) < 0.15, name


def test_anchors_outside_one_to_t_minus_b_are_refused():
    cfg = draft_config()
    draft = TrainableDraft(cfg)
    features = torch.zeros(1, T, cfg.num_taps * cfg.hidden_size)
    embeds = torch.zeros(1, 1, cfg.block_size, cfg.hidden_size)
    for s in (0, T - cfg.block_size + 1):
        with pytest.raises(ValueError, match="anchors span"):
            draft(features, torch.tensor([[s]]), embeds)
