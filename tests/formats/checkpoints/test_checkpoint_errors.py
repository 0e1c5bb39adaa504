"""Checkpoints the loader must refuse, each with a message that names what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_helpers import edit_json, edit_tensors
from dflash2.reference.formats.checkpoint import INDEX_FILE, SINGLE_FILE, load_target
from dflash2.reference.formats.errors import CheckpointError, ConfigError, UserInputError


def refused(path, error: type[UserInputError], *fragments: str) -> str:
    with pytest.raises(error) as caught:
        load_target(path)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def shard_holding(path, name: str):
    return path / json.loads((path / INDEX_FILE).read_text())["weight_map"][name]


def test_nonexistent_path(tmp_path):
    refused(tmp_path / "nowhere", ConfigError, "does not exist")


def test_folder_without_config(tmp_path):
    refused(tmp_path, ConfigError, "no config.json")


def test_wrong_model_type(copy_of):
    path = copy_of("tiny-dense")
    edit_json(path / "config.json", lambda c: c.update(model_type="qwen3"))
    refused(path, ConfigError, "model_type='qwen3'")


def test_quantization_config(copy_of):
    path = copy_of("tiny-moe")
    edit_json(path / "config.json", lambda c: c.update(quantization_config={"quant_method": "fp8"}))
    refused(path, ConfigError, "quantization_config")


def test_folder_without_weights(copy_of):
    path = copy_of("tiny-dense")
    (path / SINGLE_FILE).unlink()
    refused(path, CheckpointError, SINGLE_FILE, INDEX_FILE)


def test_deleted_tensor_is_named(copy_of):
    path = copy_of("tiny-dense")
    edit_tensors(path / SINGLE_FILE, lambda t: t.pop("model.language_model.layers.3.linear_attn.A_log"))
    refused(path, CheckpointError, "missing tensor 'model.language_model.layers.3.linear_attn.A_log'",
            "canonical 'layers.3.linear_attn.A_log'")


def test_deleted_mtp_and_head_tensors_are_named(copy_of):
    path = copy_of("tiny-moe")

    def drop(tensors):
        del tensors["mtp.layers.0.mlp.experts.gate_up_proj"], tensors["lm_head.weight"]
    edit_tensors(path / SINGLE_FILE, drop)
    refused(path, CheckpointError, "'lm_head.weight'", "'mtp.layers.0.mlp.experts.gate_up_proj'")


def test_wrong_shape_names_both_shapes(copy_of):
    path = copy_of("tiny-dense")
    name = "model.language_model.layers.2.self_attn.q_proj.weight"  # [2 * 4 * 24, 40]
    edit_tensors(path / SINGLE_FILE, lambda t: t.update({name: torch.zeros(96, 40)}))
    refused(path, CheckpointError, repr(name), "[96, 40]", "[192, 40]")


def test_missing_shard_is_named(copy_of):
    path = copy_of("tiny-moe-text")
    (path / "model-00002-of-00003.safetensors").unlink()
    refused(path, CheckpointError, "'model-00002-of-00003.safetensors'", "missing")


def test_index_pointing_at_the_wrong_shard(copy_of):
    path = copy_of("tiny-moe-text")
    name = "model.norm.weight"
    wrong = next(f for f in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors")
                 if f != shard_holding(path, name).name)
    edit_json(path / INDEX_FILE, lambda index: index["weight_map"].update({name: wrong}))
    refused(path, CheckpointError, repr(name), repr(wrong))


def test_missing_expert_is_named(copy_of):
    path = copy_of("tiny-moe-text")
    name = "model.layers.2.mlp.experts.4.up_proj.weight"
    shard = shard_holding(path, name)
    edit_tensors(shard, lambda t: t.pop(name))
    edit_json(path / INDEX_FILE, lambda index: index["weight_map"].pop(name))
    refused(path, CheckpointError, f"missing tensor {name!r}", "expert 4 of 6")


def test_per_expert_shape_is_checked(copy_of):
    path = copy_of("tiny-moe-text")
    name = "mtp.layers.0.mlp.experts.1.down_proj.weight"  # [C, I] = [40, 20]
    edit_tensors(shard_holding(path, name), lambda t: t.update({name: torch.zeros(20, 40)}))
    refused(path, CheckpointError, repr(name), "[20, 40]", "[40, 20]")


@pytest.mark.parametrize("extra", [
    "model.language_model.layers.0.mlp.gate_proj.bias",   # a bias Qwen3.5 does not have
    "model.language_model.layers.6.input_layernorm.weight",  # a layer past num_hidden_layers
    "model.layers.0.input_layernorm.weight",  # the flat layout's prefix inside a wrapper checkpoint
    "mtp.layers.1.input_layernorm.weight",  # a second MTP layer
])
def test_unexpected_tensor_is_named(copy_of, extra):
    path = copy_of("tiny-dense")
    edit_tensors(path / SINGLE_FILE, lambda t: t.update({extra: torch.zeros(40)}))
    refused(path, CheckpointError, "unexpected tensor", repr(extra))


def test_experts_stored_both_ways_are_refused(copy_of):
    path = copy_of("tiny-moe")

    def add_per_expert(tensors):
        tensors["model.language_model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(20, 40)
    edit_tensors(path / SINGLE_FILE, add_per_expert)
    refused(path, CheckpointError, "unexpected tensor", "experts.0.gate_proj.weight")


def test_flat_config_over_wrapper_tensors_gets_a_hint(copy_of):
    path = copy_of("tiny-dense")
    edit_json(path / "config.json", lambda c: c.update(c.pop("text_config")))  # model_type qwen3_5_text
    message = refused(path, CheckpointError, "missing tensor 'model.embed_tokens.weight'")
    assert "model.language_model." in message


def test_integer_tensor_is_refused(copy_of):
    path = copy_of("tiny-dense")
    name = "model.language_model.norm.weight"
    edit_tensors(path / SINGLE_FILE, lambda t: t.update({name: torch.zeros(40, dtype=torch.int8)}))
    refused(path, CheckpointError, repr(name), "I8")


def test_tied_head_that_differs_from_the_embedding(copy_of):
    path = copy_of("tiny-dense-text")
    shard = shard_holding(path, "model.embed_tokens.weight")
    edit_tensors(shard, lambda t: t.update({"lm_head.weight": torch.zeros(512, 40, dtype=torch.bfloat16)}))
    edit_json(path / INDEX_FILE, lambda index: index["weight_map"].update({"lm_head.weight": shard.name}))
    refused(path, CheckpointError, "'lm_head.weight'", "tie_word_embeddings")


def test_corrupt_safetensors_file(copy_of):
    path = copy_of("tiny-dense")
    (path / SINGLE_FILE).write_bytes(b"\xff" * 64)
    refused(path, CheckpointError, SINGLE_FILE, "not a readable safetensors file")


def test_invalid_index(copy_of):
    path = copy_of("tiny-moe-text")
    (path / INDEX_FILE).write_text('{"metadata": {}}')
    refused(path, CheckpointError, INDEX_FILE, "weight_map")
