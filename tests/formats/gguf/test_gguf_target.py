"""GGUF targets written by llama.cpp's converter load to the tensors of their safetensors source.

Per stored type: F32 bit-exact, except what the converter's own arithmetic rounds (a norm stored as ``1 + w`` gives
back ``w`` whose ``1 + w`` is bit-exact, ``A_log`` comes back through ``log(exp(.))``); F16/BF16 equal to the source
rounded to that type; Q8_0 equal to gguf-py's Q8_0 round trip of the source and within half a Q8_0 step of it (plus
its fp16 scale's rounding). The value-head reorder is exercised with r = 2 (tiny-dense) and r = 3 (tiny-moe).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from conftest import GOLDEN
from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.formats.gguf_file import GGUFModel
from dflash2.reference.formats.gguf_target import gguf_target_config, load_gguf_target, plan_gguf_target
from dflash2.reference.model.mtp import ReferenceMTP
from dflash2.reference.model.target import ReferenceTarget

GOLDENS = {  # golden file -> its source preset
    "tiny-dense-f32.gguf": "tiny-dense",
    "tiny-dense-f16.gguf": "tiny-dense",
    "tiny-dense-q8_0.gguf": "tiny-dense",
    "tiny-moe-f32.gguf": "tiny-moe",
    "tiny-moe-bf16-fused.gguf": "tiny-moe",
}
# Canonical norms the converter stores as 1 + w (the GDN output norm linear_attn.norm stays w).
ONE_PLUS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
            "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def _one_plus(canonical: str) -> bool:
    return canonical.endswith(ONE_PLUS) or canonical in ("norm.weight", "mtp.norm.weight")


_loaded: dict[str, tuple] = {}


def _load(sources, golden: str):
    if golden not in _loaded:
        _loaded[golden] = (load_gguf_target(GOLDEN / golden), load_target(sources / GOLDENS[golden]))
    return _loaded[golden]


@pytest.mark.parametrize("golden", GOLDENS)
def test_config_matches_source(sources, golden):
    (cfg, _), (source_cfg, _) = _load(sources, golden)
    # What the file cannot say: the HF wrapper's model_type and prefix; its eos is the tokenizer's <|im_end|>.
    assert cfg == dataclasses.replace(source_cfg, model_type=source_cfg.model_type + "_text",
                                      weight_prefix="model.", eos_token_ids=(497,))


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 4) -> bool:
    """Equal up to a few float32 ulps: the sources' factories and the A_log round trip call torch's exp and
    log, whose last bits differ between CPU instruction sets (reference/tiny/fingerprint.py), so a golden
    converted on one machine is compared with sources regenerated on another. Any real mapping error
    (a wrong tensor, a missed transform, a permutation) is far larger."""
    bound = ulps * torch.finfo(torch.float32).eps * want.abs()
    return got.shape == want.shape and bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("golden", GOLDENS)
def test_tensors_match_source(sources, golden):
    (cfg, tensors), (_, source) = _load(sources, golden)
    assert set(tensors) == set(source)
    model = GGUFModel(GOLDEN / golden)
    plan = plan_gguf_target(cfg, model)
    seen = set()
    for canonical, src in source.items():
        if canonical == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        got, qtypes = tensors[canonical], {model.type_of(n) for n in plan[canonical]}
        (qtype,) = qtypes
        seen.add(qtype)
        where = f"{golden}: {canonical} ({qtype.name})"
        if qtype == Q.F32:
            if _one_plus(canonical):
                assert not torch.equal(got, src + 1), where  # the + 1 was undone
                assert torch.equal(got + 1, src + 1), where
            elif canonical.endswith("A_log"):
                assert _within_ulps(got, torch.log(torch.exp(src))), where
            else:
                assert _within_ulps(got, src), where
        elif qtype in (Q.F16, Q.BF16):
            rounded = src.to(torch.float16 if qtype == Q.F16 else torch.bfloat16).float()
            assert torch.equal(got, rounded), where
            assert not torch.equal(got, src), where  # a 16-bit round trip of random fp32 loses bits
        else:
            assert qtype == Q.Q8_0, where
            # only the attention output projection is wide enough (96 = 3 x 32) for Q8_0 in these configs,
            # and the converter stores it untransformed, so the source's own Q8_0 round trip is the oracle
            assert canonical.endswith("self_attn.o_proj.weight"), where
            trip = dequantize(quantize(src.numpy(), Q.Q8_0), Q.Q8_0)
            assert np.array_equal(got.numpy(), trip), where
            blocks = src.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127  # per block of 32; stored as an fp16 scale,
            bound = step * (0.5 + 127 * 2.0**-11)  # so a code of up to 127 carries the scale's rounding too
            assert ((got.reshape(-1, 32) - blocks).abs() <= bound).all(), where
    expected_types = {"f32": {Q.F32}, "f16": {Q.F32, Q.F16}, "q8_0": {Q.F32, Q.F16, Q.Q8_0},
                      "bf16-fused": {Q.F32, Q.BF16}}
    assert seen == expected_types[golden.split("-", 2)[2].removesuffix(".gguf")]


def test_fused_gate_up_experts(sources):
    cfg, _ = _load(sources, "tiny-moe-bf16-fused.gguf")[0]
    model = GGUFModel(GOLDEN / "tiny-moe-bf16-fused.gguf")
    assert plan_gguf_target(cfg, model)["layers.0.mlp.experts.gate_up_proj"] == ("blk.0.ffn_gate_up_exps.weight",)
    split = GGUFModel(GOLDEN / "tiny-moe-f32.gguf")
    assert plan_gguf_target(cfg, split)["layers.0.mlp.experts.gate_up_proj"] == (
        "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight")


def test_layer_kinds_from_recurrent_layers(sources):
    model = GGUFModel(GOLDEN / "tiny-moe-f32.gguf")
    assert model.metadata["qwen35moe.full_attention_interval"] == 2
    assert gguf_target_config(model).layer_types == (
        "linear_attention", "full_attention", "linear_attention", "full_attention")


@pytest.mark.parametrize("golden", ["tiny-dense-f32.gguf", "tiny-moe-f32.gguf"])
def test_f32_logits_match_safetensors(sources, golden):
    (cfg, tensors), (source_cfg, source) = _load(sources, golden)
    tokens = torch.tensor([495, 3, 77, 150, 9, 320, 41, 12, 260, 7, 88])
    ours, theirs = ReferenceTarget(cfg, tensors).forward(tokens), ReferenceTarget(source_cfg, source).forward(tokens)
    assert (ours.logits - theirs.logits).abs().max() < 1e-5
    # the MTP head reads the two norms the converter renames (nextn.enorm / hnorm)
    next_tokens = torch.cat([tokens[1:], tokens[:1]])
    mtp, source_mtp = ReferenceMTP(cfg, tensors), ReferenceMTP(source_cfg, source)
    assert (mtp.forward(ours.hidden, next_tokens).logits
            - source_mtp.forward(theirs.hidden, next_tokens).logits).abs().max() < 1e-5
