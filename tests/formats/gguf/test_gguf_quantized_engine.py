"""The fast engine keeps a GGUF target's quantized matrices as their blocks (fast/weights/gguf_quantized.py).

- Loading: on llama.cpp's quantized goldens (golden/llama), every matrix stored as a type the kernels decode is a
  QuantParam, and its dequantization (its input columns put back in canonical order) equals the reference
  loader's tensor bit for bit; everything else is the reference loader's tensor.
- The converter's value-head reorder on a quantized matrix: rows move (in_proj_z), input columns are permuted at
  run time (out_proj), each against the canonical matrix; a planted bug (no input permutation) must fail.
- Forward: the fast model holds QuantParams, and the engine's greedy tokens with the GPU forms (the fused
  dequant-matmul kernels under Triton's interpreter) equal its tokens with the torch twins, dense and MoE.
  (test_llama_oracle.py checks the engine's tokens against the reference runner's on every file.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from dflash2.fast.kernels.common.dispatch import forced_gpu, forced_torch
from dflash2.fast.kernels.common.triton_compat import HAS_TRITON
from dflash2.fast.kernels.quant.dequant_torch import dequantize_torch
from dflash2.fast.kernels.quant.layout import QUANT_TYPES, QuantWeight
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.fast.weights.gguf_quantized import QuantParam, load_gguf_target_quantized, quant_param
from dflash2.fast.model.linear import linear
from dflash2.reference.formats.gguf_file import GGUFModel
from dflash2.reference.formats.gguf_target import load_gguf_target, plan_gguf_target, value_heads_grouped
from dflash2.reference.tiny.target import PRESETS, tiny_config_json
from dflash2.reference.formats.config import parse_target_config

LLAMA = Path(__file__).parent / "golden" / "llama"  # (not conftest's GOLDEN: another conftest may be the one imported)
FILES = sorted(p.name for p in LLAMA.glob("*.gguf"))


def canonical_values(param: QuantParam) -> torch.Tensor:
    """The canonical matrix a QuantParam stands for, in float32."""
    dense = dequantize_torch(param.weight, torch.float32)
    if param.input_perm is not None:
        dense = dense[..., torch.argsort(param.input_perm)]
    return dense


@pytest.mark.parametrize("name", FILES)
def test_quantized_load_equals_reference_load(name):
    path = LLAMA / name
    cfg, kept = load_gguf_target_quantized(path)
    ref_cfg, reference = load_gguf_target(path)
    assert cfg == ref_cfg and set(kept) == set(reference)
    model = GGUFModel(path)
    plan = plan_gguf_target(cfg, model)
    quantized = 0
    for canonical, value in kept.items():
        if canonical == "lm_head.weight" and cfg.tie_word_embeddings:
            assert value is kept["embed_tokens.weight"]
            continue
        types = {model.type_of(n) for n in plan[canonical]}
        if isinstance(value, QuantParam):
            quantized += 1
            assert types <= set(QUANT_TYPES), canonical
            assert torch.equal(canonical_values(value), reference[canonical]), canonical
        else:
            assert not (types <= set(QUANT_TYPES) and reference[canonical].dim() >= 2), canonical
            assert torch.equal(value, reference[canonical]), canonical
    assert quantized >= 8, f"{name}: only {quantized} matrices kept quantized"


def _gdn_config():
    """A target config whose GDN has 2 key and 4 value heads of 16 (out_proj reads 64 columns: Q8_0 blocks)."""
    cfg = parse_target_config(tiny_config_json(PRESETS["tiny-dense"]))
    return dataclasses.replace(cfg, linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=16)


def _file_order(canonical_matrix: torch.Tensor, order: torch.Tensor, dim: int) -> torch.Tensor:
    """The matrix as the converter stored it: canonical index j holds file index order[j] along ``dim``."""
    stored = torch.empty_like(canonical_matrix)
    if dim == 0:
        stored[order] = canonical_matrix
    else:
        stored[:, order] = canonical_matrix
    return stored


def _q8_0(matrix: torch.Tensor) -> QuantWeight:
    raw = quantize(matrix.numpy().astype(np.float32), Q.Q8_0)
    return QuantWeight.from_bytes(raw, Q.Q8_0, tuple(matrix.shape))


def test_value_heads_regrouped_on_quantized_matrices():
    cfg = _gdn_config()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)

    name = "layers.0.linear_attn.out_proj.weight"  # [C, Hv Dv]: the input columns carry the value heads
    canonical = torch.randn(32, 64, generator=gen)
    order = value_heads_grouped(cfg, name, torch.arange(64).unsqueeze(0))[0]
    assert not torch.equal(order, torch.arange(64))
    stored = _q8_0(_file_order(canonical, order, dim=1))
    param = quant_param(cfg, name, [stored], (32, 64))
    assert param.input_perm is not None
    want = dequantize_torch(stored)[:, order]  # the canonical matrix, as quantized
    torch.testing.assert_close(linear(x, param), x @ want.T, rtol=1e-6, atol=1e-5)
    unpermuted = QuantParam(param.weight)  # planted: the input left in canonical order
    assert (linear(x, unpermuted) - x @ want.T).abs().max() > 0.1

    name = "layers.0.linear_attn.in_proj_z.weight"  # [Hv Dv, C]: the rows carry the value heads
    canonical = torch.randn(64, 32, generator=gen)
    order = value_heads_grouped(cfg, name, torch.arange(64).unsqueeze(1))[:, 0]
    stored = _q8_0(_file_order(canonical, order, dim=0))
    param = quant_param(cfg, name, [stored], (64, 32))
    assert param.input_perm is None
    assert torch.equal(dequantize_torch(param.weight), dequantize_torch(stored)[order])


def _tokens(path, gpu: bool) -> list[int]:
    llm = LLM(str(path), dtype="float32", device="cpu")
    with (forced_gpu() if gpu else forced_torch()):
        out = llm.generate([[3, 14, 15, 92, 65]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return out[0].token_ids


@pytest.mark.parametrize("name", ["tiny-dense-256-q4_k.gguf", "tiny-moe-256-iq3_xxs.gguf"])
def test_engine_holds_blocks_and_fused_kernels_give_its_tokens(name):
    llm = LLM(str(LLAMA / name), dtype="float32", device="cpu")
    layer = llm.engine.model.target.layers[0]
    assert isinstance(layer.mixer.w_in, (QuantParam, tuple))
    assert isinstance(llm.engine.model.target.lm_head, QuantParam)
    if not HAS_TRITON:
        pytest.skip("Triton is not installed: no GPU forms to compare")
    assert _tokens(LLAMA / name, gpu=True) == _tokens(LLAMA / name, gpu=False)
