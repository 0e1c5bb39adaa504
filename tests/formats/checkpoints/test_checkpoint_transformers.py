"""transformers loads what the factory writes, key for key and value for value: the format is real."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.tiny.target import PRESETS

CAUSAL_LM = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
             "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


def hf_load(path, **kwargs):
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_transformers_loads_every_preset_with_our_values(written, preset):
    path = written(preset)
    model, info = hf_load(path, output_loading_info=True)
    cfg, weights = load_target(path)
    assert type(model).__name__ == CAUSAL_LM[cfg.model_type]
    assert not info["missing_keys"]
    assert [k for k in info["unexpected_keys"] if not k.startswith("mtp.")] == []
    assert not info["mismatched_keys"] and not info["error_msgs"]

    hf_state = model.state_dict()
    ours = {("model." + k if k != "lm_head.weight" else k): v for k, v in weights.items() if not k.startswith("mtp.")}
    assert hf_state.keys() == ours.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(tensor, ours[name]), name


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dense-text"])
def test_greedy_decoding_does_not_collapse(written, preset):
    """Random weights, but not degenerate: greedy decoding keeps producing new tokens."""
    model = hf_load(written(preset))
    prompt = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, prompt.shape[1]:].tolist()
    assert len(set(tokens)) >= 15, tokens
    assert len(set(tokens[-10:])) >= 4, tokens


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_wrapper_loads_into_the_multimodal_class(written, preset):
    """The wrapper layout is the one the real VLM classes read: only the (absent) vision tower is missing."""
    transformers.logging.set_verbosity_error()
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        written(preset), dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    assert info["missing_keys"] and all(k.startswith("model.visual.") for k in info["missing_keys"])
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    _, weights = load_target(written(preset))
    state = model.state_dict()
    for name, tensor in weights.items():
        if not name.startswith("mtp."):
            hf_name = name if name == "lm_head.weight" else "model.language_model." + name
            assert torch.equal(state[hf_name], tensor), name
