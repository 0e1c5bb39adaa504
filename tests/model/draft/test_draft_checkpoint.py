"""Draft tensors: every name and shape of the facts sheet, missing / misshaped / unexpected ones named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2.reference.formats.draft_checkpoint import expected_draft_shapes, load_draft
from dflash2.reference.formats.errors import CheckpointError, ConfigError


def _rewrite(src, dst, edit):
    """Copy a draft folder, editing its tensor dict."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_released_tensor_table(draft_dir, target_cfg):
    cfg, weights = load_draft(draft_dir, target_cfg)
    shapes = expected_draft_shapes(cfg)
    c, m = cfg.hidden_size, cfg.num_taps
    assert shapes["fc.weight"] == (c, m * c)
    assert shapes["candidate_selector.predecessor_codebook"] == (cfg.vocab_size, cfg.selector_rank)
    assert "candidate_selector.successor_codebook.weight" not in shapes  # stored without .weight
    assert shapes["layers.1.attention_conv.kernel_projection.weight"] == (2 * 2 * c // cfg.conv_group_size, c)
    assert shapes["layers.0.mlp_conv.base_kernel"] == (2, 2, c)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (cfg.head_dim,)
    assert len(shapes) == 6 + 15 * cfg.num_hidden_layers
    assert set(weights) == set(shapes) and all(w.dtype == torch.float32 for w in weights.values())


@pytest.mark.parametrize("name", ["fc.weight", "candidate_selector.successor_codebook",
                                  "layers.1.mlp_conv.kernel_projection.weight", "layers.0.self_attn.k_norm.weight"])
def test_missing_tensor_is_named(tmp_path, draft_dir, target_cfg, name):
    folder = _rewrite(draft_dir, tmp_path / "d", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_draft(folder, target_cfg)


def test_fc_in_features_must_be_m_times_hidden(tmp_path, draft_dir, target_cfg):
    def shrink(t):
        t["fc.weight"] = t["fc.weight"][:, :-target_cfg.hidden_size].contiguous()
    folder = _rewrite(draft_dir, tmp_path / "d", shrink)
    with pytest.raises(CheckpointError, match=r"'fc.weight'.*in-features"):
        load_draft(folder, target_cfg)


@pytest.mark.parametrize("name", ["layers.0.attention_conv.kernel_projection.weight",
                                  "layers.1.attention_conv.base_kernel", "candidate_selector.hidden_projection.weight"])
def test_misshaped_tensor_is_named(tmp_path, draft_dir, target_cfg, name):
    def misshape(t):
        t[name] = torch.zeros(*t[name].shape[:-1], t[name].shape[-1] + 1)
    folder = _rewrite(draft_dir, tmp_path / "d", misshape)
    with pytest.raises(CheckpointError, match=f"'{name}' has shape"):
        load_draft(folder, target_cfg)


@pytest.mark.parametrize("name", ["embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight"])
def test_borrowed_tensors_are_refused(tmp_path, draft_dir, target_cfg, name):
    def add(t):
        t[name] = torch.zeros(target_cfg.vocab_size, target_cfg.hidden_size)
    folder = _rewrite(draft_dir, tmp_path / "d", add)
    with pytest.raises(CheckpointError, match=f"{name}.*borrows the target"):
        load_draft(folder, target_cfg)


def test_unexpected_tensor_is_named(tmp_path, draft_dir, target_cfg):
    folder = _rewrite(draft_dir, tmp_path / "d", lambda t: t.update({"layers.0.self_attn.sinks": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match="layers.0.self_attn.sinks"):
        load_draft(folder, target_cfg)


def test_integer_tensor_is_refused(tmp_path, draft_dir, target_cfg):
    name = "layers.0.mlp.up_proj.weight"
    folder = _rewrite(draft_dir, tmp_path / "d", lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(CheckpointError, match=f"'{name}' is stored as I8"):
        load_draft(folder, target_cfg)


def test_sharded_draft_loads_the_same(tmp_path, draft_dir, target_cfg):
    tensors = load_file(str(draft_dir / "model.safetensors"))
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(draft_dir / "config.json", folder / "config.json")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / shard))
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, single = load_draft(draft_dir, target_cfg)
    _, sharded = load_draft(folder, target_cfg)
    assert single.keys() == sharded.keys() and all(torch.equal(single[n], sharded[n]) for n in single)


def test_config_refusal_comes_first(draft_dir, target_cfg):
    with pytest.raises(ConfigError, match="speculative_num_steps"):
        load_draft(draft_dir, target_cfg, k=99)
