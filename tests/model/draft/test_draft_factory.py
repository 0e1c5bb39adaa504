"""The tiny draft factory: a real-format draft that load_draft accepts, deterministic, not degenerate;
and one end-to-end run on a real tiny target's taps."""

from __future__ import annotations

import json

import torch

from dflash2.reference.model.draft import ReferenceDraft
from dflash2.reference.formats.draft_checkpoint import load_draft
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.speculative.selector import CandidateSelector, select, selector_uniforms


def test_factory_writes_the_released_layout(draft_dir, target_cfg):
    raw = json.loads((draft_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["model_type"] == "qwen3"
    assert raw["is_causal"] is False and set(raw["layer_types"]) == {"sliding_attention"}
    assert raw["dflash_config"]["mask_token_id"] == target_cfg.vocab_size - 1
    assert raw["num_target_layers"] == target_cfg.num_hidden_layers
    cfg, _ = load_draft(draft_dir, target_cfg)
    assert cfg.hidden_size == target_cfg.hidden_size and cfg.selector_top_k == 16


def test_factory_is_deterministic_from_seed(tmp_path, target_cfg):
    a = load_draft(write_tiny_draft(tmp_path / "a", target_cfg, seed=3), target_cfg)[1]
    b = load_draft(write_tiny_draft(tmp_path / "b", target_cfg, seed=3), target_cfg)[1]
    c = load_draft(write_tiny_draft(tmp_path / "c", target_cfg, seed=4), target_cfg)[1]
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])


def test_drafts_are_not_degenerate(draft):
    cfg = draft.cfg
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(16)
    k, v = draft.context_kv(torch.randn(16, cfg.hidden_size, generator=gen), positions)
    selector = CandidateSelector.from_draft(cfg, draft.w)
    paths, top_q = set(), []
    for anchor in range(0, cfg.vocab_size, 7):
        block = draft.forward_block(anchor, 16, positions, k, v)
        assert torch.isfinite(block.logits).all()
        paths.add(tuple(select(block, selector, anchor, cfg.k, 0.0).tokens.tolist()))
        top_q.append(float(select(block, selector, anchor, 1, 1.0, [0.5]).draft_probs.max()))
    assert len(paths) > 3  # the drafts depend on the anchor
    assert 0.2 < sum(top_q) / len(top_q) < 0.98  # q is neither one-hot nor flat


def test_end_to_end_on_a_real_tiny_target(tmp_path):
    from dflash2.reference.formats.checkpoint import load_target
    from dflash2.reference.tiny.target import write_tiny_target
    from dflash2.reference.model.target import ReferenceTarget

    target_path = write_tiny_target(tmp_path / "target", "tiny-dense", tokenizer=None)
    target_cfg, target_weights = load_target(target_path)
    draft_path = write_tiny_draft(tmp_path / "draft", target_path, seed=1, block_size=8)
    cfg, weights = load_draft(draft_path, target_cfg)
    draft = ReferenceDraft(cfg, weights, target_weights)
    target = ReferenceTarget(target_cfg, target_weights)

    prompt = torch.arange(3, 15)  # 12 tokens at positions 0..11
    out = target.forward(prompt)
    rows = draft.context_rows(out.taps)  # [12, C]
    k, v = draft.context_kv(rows, torch.arange(12))
    anchor, s = int(out.logits[-1].argmax()), 12
    block = draft.forward_block(anchor, s, torch.arange(12), k, v)
    selector = CandidateSelector.from_draft(cfg, weights)
    greedy = select(block, selector, anchor, cfg.k, 0.0)
    sampled = select(block, selector, anchor, 3, 1.0, selector_uniforms(11, s, 3))
    assert greedy.tokens.shape == (7,) and sampled.tokens.shape == (3,)
    assert int(greedy.tokens.max()) < target_cfg.vocab_size and torch.isfinite(sampled.draft_probs).all()
    torch.testing.assert_close(sampled.draft_probs.sum(-1), torch.ones(3))
    # context rows are per position: the rows of a prefix are the prefix of the rows
    torch.testing.assert_close(draft.context_rows(target.forward(prompt[:5]).taps), rows[:5], rtol=1e-4, atol=1e-5)
