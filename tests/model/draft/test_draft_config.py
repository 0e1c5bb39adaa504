"""Startup refusals of a draft config.json: each names the field (the seed's 'Refused at startup' list)."""

from __future__ import annotations

import copy
import json

import pytest

from dflash2.reference.formats.draft_config import load_draft_config, parse_draft_config
from dflash2.reference.tiny.draft import tiny_draft_config
from dflash2.reference.formats.errors import ConfigError


@pytest.fixture
def raw(target_cfg):
    return tiny_draft_config(target_cfg, num_layers=2, block_size=8)


def _set(path: str, value):
    """A mutation setting ``a.b`` (creating nothing but the last key); DELETE removes it."""
    def mutate(raw):
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return mutate


DELETE = object()

REFUSALS = [
    ("dflash1", _set("architectures", ["DFlashDraftModel"]), "DFlash 1"),
    ("other-arch", _set("architectures", ["Qwen3ForCausalLM"]), "architectures"),
    ("model-type", _set("model_type", "llama"), "model_type"),
    ("quantized", _set("quantization_config", {"quant_method": "fp8"}), "quantization_config"),
    ("causal-missing", _set("is_causal", DELETE), "is_causal"),
    ("causal-true", _set("is_causal", True), "is_causal"),
    ("dflash-causal", _set("dflash_config.causal", True), "dflash_config.causal"),
    ("full-attention-layer", _set("layer_types", ["sliding_attention", "full_attention"]), "layer_types[1]"),
    ("layer-types-length", _set("layer_types", ["sliding_attention"] * 3), "layer_types"),
    ("layer-types-missing", _set("layer_types", DELETE), "layer_types"),
    ("window-below-block", _set("sliding_window", 4), "sliding_window"),
    ("rope-yarn", _set("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope_type"),
    ("rope-scaling-key", _set("rope_parameters.factor", 2.0), "rope_parameters.factor"),
    ("legacy-rope-scaling", _set("rope_scaling", {"type": "linear", "factor": 2.0}), "rope_scaling"),
    ("partial-rotary", _set("rope_parameters.partial_rotary_factor", 0.5), "partial_rotary_factor"),
    ("partial-rotary-top", _set("partial_rotary_factor", 0.25), "partial_rotary_factor"),
    ("not-neox", _set("is_neox_style", False), "is_neox_style"),
    ("interleaved", _set("rope_interleaved", True), "rope_interleaved"),
    ("output-multiplier", _set("dflash_config.output_multiplier", 0.196), "output_multiplier"),
    ("softcap", _set("dflash_config.final_logit_softcapping", 20.0), "final_logit_softcapping"),
    ("softcap-top", _set("final_logit_softcapping", 30.0), "final_logit_softcapping"),
    ("embedding-scale", _set("input_embedding_scale", 2.0), "input_embedding_scale"),
    ("embedding-scale-dflash", _set("dflash_config.input_embedding_scale", 0.5), "input_embedding_scale"),
    ("top-k-not-pow2", _set("dflash_config.selector_top_k", 6), "selector_top_k"),
    ("rank-not-pow2", _set("dflash_config.selector_rank", 12), "selector_rank"),
    ("head-dim-not-pow2", _set("head_dim", 24), "head_dim"),
    ("group-not-divisor", _set("dflash_config.conv_group_size", 32), "conv_group_size"),
    ("layer-ids-empty", _set("dflash_config.target_layer_ids", []), "target_layer_ids"),
    ("layer-ids-repeated", _set("dflash_config.target_layer_ids", [1, 1]), "target_layer_ids"),
    ("layer-ids-negative", _set("dflash_config.target_layer_ids", [-1, 2]), "target_layer_ids"),
    ("layer-ids-too-deep", _set("dflash_config.target_layer_ids", [0, 4]), "target_layer_ids"),
    ("hidden-mismatch", _set("hidden_size", 64), "hidden_size"),
    ("vocab-mismatch", _set("vocab_size", 128), "vocab_size"),
    ("mask-outside-vocab", _set("dflash_config.mask_token_id", 96), "mask_token_id"),
    ("mask-negative", _set("dflash_config.mask_token_id", -1), "mask_token_id"),
    ("num-target-layers", _set("num_target_layers", 64), "num_target_layers"),
    ("no-dflash-config", _set("dflash_config", DELETE), "dflash_config"),
    ("attention-bias", _set("attention_bias", True), "attention_bias"),
]


@pytest.mark.parametrize("mutate, field", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusal_names_the_field(raw, target_cfg, mutate, field):
    raw = copy.deepcopy(raw)
    mutate(raw)
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_draft_config(raw, target_cfg)


@pytest.mark.parametrize("k", [0, 8, -1, 2.0])
def test_k_outside_one_to_block_minus_one(raw, target_cfg, k):
    with pytest.raises(ConfigError, match="speculative_num_steps"):
        parse_draft_config(raw, target_cfg, k)


def test_accepts_the_released_layout_and_resolves_k(raw, target_cfg):
    cfg = parse_draft_config(raw, target_cfg)
    assert cfg.k == cfg.block_size - 1 == 7
    assert parse_draft_config(raw, target_cfg, 1).k == 1
    assert cfg.num_conv_groups * cfg.conv_group_size == cfg.hidden_size
    zero_cap = copy.deepcopy(raw)
    zero_cap["dflash_config"]["final_logit_softcapping"] = 0.0  # 0 means off (vLLM, z-lab MLX)
    zero_cap["dflash_config"]["output_multiplier"] = 1.0
    parse_draft_config(zero_cap, target_cfg)


@pytest.mark.parametrize("case", ["none", "empty", "missing", "no-config"])
def test_bad_draft_path(tmp_path, target_cfg, case):
    path = {"none": None, "empty": "", "missing": tmp_path / "nope", "no-config": tmp_path}[case]
    with pytest.raises(ConfigError, match="speculative_draft_model_path"):
        load_draft_config(path, target_cfg)


def test_loads_from_a_folder(tmp_path, raw, target_cfg):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_draft_config(tmp_path, target_cfg, 3).k == 3
