"""Factory -> disk -> loader: every layout the factory writes loads back to the canonical tensors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2.reference.formats.checkpoint import INDEX_FILE, SINGLE_FILE, list_checkpoint_tensors, load_target
from dflash2.reference.tiny.target import (PRESETS, TinyTargetSpec, describe, tiny_target_config,
                                       tiny_target_weights, write_tiny_target)
from dflash2.reference.tiny.weights import KEEP_FP32_SUFFIXES
from dflash2.reference.formats.weights import expected_target_shapes


def stored_value(spec: TinyTargetSpec, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What the fp32 canonical ``tensor`` reads back as after being written under ``spec``."""
    if spec.dtype == "bfloat16" and not name.endswith(KEEP_FP32_SUFFIXES):
        return tensor.to(torch.bfloat16).to(torch.float32)
    return tensor


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_round_trip(written, preset):
    spec = PRESETS[preset]
    cfg, weights = load_target(written(preset))
    assert cfg == tiny_target_config(spec)
    expected = expected_target_shapes(cfg)
    assert weights.keys() == expected.keys()
    truth = tiny_target_weights(cfg, spec.seed)
    for name, shape in expected.items():
        assert tuple(weights[name].shape) == shape, name
        assert weights[name].dtype == torch.float32, name
        assert torch.equal(weights[name], stored_value(spec, name, truth[name])), name
    if cfg.tie_word_embeddings:
        assert weights["lm_head.weight"] is weights["embed_tokens.weight"]
    assert bool(cfg.mtp_num_hidden_layers) == spec.mtp


MOE_MTP = TinyTargetSpec(kind="moe", num_layers=4, full_attention_interval=2, seed=11)
LAYOUTS = {
    "wrapper-fused-single": dict(wrapper=True, expert_format="fused", num_shards=1),
    "wrapper-per-expert-sharded": dict(wrapper=True, expert_format="per_expert", num_shards=2),
    "flat-fused-sharded": dict(wrapper=False, expert_format="fused", num_shards=4),
    "flat-per-expert-single": dict(wrapper=False, expert_format="per_expert", num_shards=1),
}


def test_every_layout_loads_the_same_tensors(tmp_path):
    loaded = {}
    for layout, fields in LAYOUTS.items():
        path = write_tiny_target(tmp_path / layout, replace(MOE_MTP, **fields), tokenizer=None)
        names = set(list_checkpoint_tensors(path))
        prefix = "model.language_model." if fields["wrapper"] else "model."
        per_expert = f"{prefix}layers.0.mlp.experts.5.up_proj.weight"
        assert (per_expert in names) == (fields["expert_format"] == "per_expert")
        assert ("mtp.layers.0.mlp.experts.0.down_proj.weight" in names) == (fields["expert_format"] == "per_expert")
        assert ("mtp.layers.0.mlp.experts.gate_up_proj" in names) == (fields["expert_format"] == "fused")
        assert f"{prefix}embed_tokens.weight" in names and "lm_head.weight" in names and "mtp.fc.weight" in names
        assert (path / INDEX_FILE).is_file() == (fields["num_shards"] > 1)
        assert (path / SINGLE_FILE).is_file() == (fields["num_shards"] == 1)
        loaded[layout] = load_target(path)[1]
    reference = loaded.pop("wrapper-fused-single")
    for layout, weights in loaded.items():
        assert weights.keys() == reference.keys(), layout
        for name in reference:
            assert torch.equal(weights[name], reference[name]), (layout, name)


def test_fused_experts_put_gate_rows_first(tmp_path):
    """``gate_up_proj[j]`` is expert j's gate_proj rows, then its up_proj rows."""
    path = write_tiny_target(tmp_path, replace(MOE_MTP, expert_format="per_expert"), tokenizer=None)
    stored = load_file(path / SINGLE_FILE)
    weights = load_target(path)[1]
    i = MOE_MTP.moe_intermediate_size
    for j in (0, MOE_MTP.num_experts - 1):
        gate_up = weights["layers.1.mlp.experts.gate_up_proj"][j]
        assert torch.equal(gate_up[:i], stored[f"model.language_model.layers.1.mlp.experts.{j}.gate_proj.weight"])
        assert torch.equal(gate_up[i:], stored[f"model.language_model.layers.1.mlp.experts.{j}.up_proj.weight"])
        assert torch.equal(weights["mtp.layers.0.mlp.experts.down_proj"][j],
                           stored[f"mtp.layers.0.mlp.experts.{j}.down_proj.weight"])


def test_shards_split_the_tensors_and_index_them(written):
    path = written("tiny-moe-text")
    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert [s.name for s in shards] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    by_shard = {s.name: set(load_file(s)) for s in shards}
    assert all(by_shard.values())
    assert {n: f for f, names in by_shard.items() for n in names} == index["weight_map"]
    total = sum(t.numel() * t.element_size() for s in shards for t in load_file(s).values())
    assert index["metadata"]["total_size"] == total


def test_bf16_checkpoint_keeps_gdn_decay_and_norm_fp32(written):
    """As Qwen3.5 releases do: ``A_log`` and the GDN output norm stay F32 in a BF16 checkpoint."""
    stored = list_checkpoint_tensors(written("tiny-dense-text"))
    for name, info in stored.items():
        assert info.dtype == ("F32" if name.endswith(KEEP_FP32_SUFFIXES) else "BF16"), name
    cfg, weights = load_target(written("tiny-dense-text"), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_tied_checkpoint_may_ship_a_copy_of_the_embedding(copy_of):
    path = copy_of("tiny-dense-text")
    shard = next(f for f in sorted(path.glob("model-*.safetensors")) if
                 "model.embed_tokens.weight" in load_file(f))
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = shard.name
    (path / INDEX_FILE).write_text(json.dumps(index))
    _, weights = load_target(path)
    assert weights["lm_head.weight"] is weights["embed_tokens.weight"]


def test_vision_tower_is_skipped(copy_of):
    path = copy_of("tiny-dense")
    tensors = load_file(path / SINGLE_FILE)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(48, 16)
    tensors["model.visual.merger.linear_fc2.weight"] = torch.ones(40, 64)
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
    _, weights = load_target(path)
    assert not any("visual" in name for name in weights)


def test_mtp_tensors_are_unused_when_the_config_has_no_mtp_layer(copy_of):
    path = copy_of("tiny-dense")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 0
    (path / "config.json").write_text(json.dumps(config))
    cfg, weights = load_target(path)
    assert cfg.mtp_num_hidden_layers == 0
    assert not any(name.startswith("mtp.") for name in weights)


def test_same_spec_same_bytes(tmp_path):
    spec = PRESETS["tiny-moe-text"]
    first = write_tiny_target(tmp_path / "a", spec, tokenizer=None)
    second = write_tiny_target(tmp_path / "b", spec, tokenizer=None)
    other_seed = write_tiny_target(tmp_path / "c", replace(spec, seed=spec.seed + 1), tokenizer=None)
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "config.json").read_bytes() == (other_seed / "config.json").read_bytes()
    shard = "model-00002-of-00003.safetensors"
    assert (first / shard).read_bytes() != (other_seed / shard).read_bytes()


def test_random_weights_are_not_degenerate(written):
    cfg, weights = load_target(written("tiny-dense"))
    for name, tensor in weights.items():
        assert tensor.std() > 0.01, name  # nothing constant, zero-centred norms included
    norms = [n for n in weights if n.endswith("layernorm.weight")]
    assert all(weights[n].abs().mean() > 0.05 for n in norms)  # 1 + w and w differ
    decay = torch.cat([weights[f"layers.{i}.linear_attn.A_log"].exp() for i in cfg.linear_attention_layers])
    assert decay.min() >= 1.0 and decay.max() <= 16.0


def test_small_tokenizer_is_written_and_config_does_not_depend_on_it(tmp_path, written):
    pytest.importorskip("dflash2.reference.tiny.tokenizer")
    from dflash2.reference.formats.tokenizer import eos_token_ids, load_tokenizer

    path = write_tiny_target(tmp_path, "tiny-dense")
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    bare = written("tiny-dense")
    for name in ("config.json", "generation_config.json", SINGLE_FILE):
        assert (path / name).read_bytes() == (bare / name).read_bytes(), name
    tokenizer = load_tokenizer(path)
    assert eos_token_ids(path) == (tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                   tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    assert max(tokenizer.get_vocab().values()) < PRESETS["tiny-dense"].vocab_size


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    pytest.importorskip("dflash2.reference.tiny.tokenizer")
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_target(tmp_path, replace(PRESETS["tiny-dense"], vocab_size=300), tokenizer="small")


def test_describe_lists_every_preset():
    lines = describe().splitlines()
    assert [line.split(":")[0] for line in lines] == list(PRESETS)
    assert "V=248320" in describe("tiny-dense-qwen-vocab")
    assert "per_expert" in describe("tiny-moe-text")


def test_writing_again_replaces_the_weight_files(tmp_path):
    path = write_tiny_target(tmp_path, "tiny-moe-text", tokenizer=None)
    write_tiny_target(tmp_path, "tiny-moe", tokenizer=None)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "generation_config.json", SINGLE_FILE]
    assert load_target(path)[0] == tiny_target_config("tiny-moe")


def test_fp16_checkpoint_loads_converted(copy_of):
    path = copy_of("tiny-dense")
    tensors = load_file(path / SINGLE_FILE)
    save_file({n: t.half() for n, t in tensors.items()}, path / SINGLE_FILE, metadata={"format": "pt"})
    _, weights = load_target(path)
    assert torch.equal(weights["norm.weight"], tensors["model.language_model.norm.weight"].half().float())
    assert weights["norm.weight"].dtype == torch.float32


def test_dtype_none_keeps_each_tensor_as_stored(tmp_path):
    from dflash2.reference.formats.checkpoint import load_target
    from dflash2.reference.tiny.target import write_tiny_target

    path = write_tiny_target(tmp_path / "t", "tiny-dense-text", tokenizer=None)  # bf16 with F32 A_log, like releases
    _, stored = load_target(path, dtype=None)
    _, fp32 = load_target(path)
    assert stored["layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.bfloat16
    assert stored["layers.0.linear_attn.A_log"].dtype == torch.float32
    assert all(torch.equal(stored[name].float(), fp32[name]) for name in fp32)
