"""``--load-format dummy --dummy-weight-type T``: a quantized target at a config's shape with no file
(fast/weights/dummy_quantized.py), and its refusals."""

from __future__ import annotations

import pytest

from dflash2.fast.engine.config import DUMMY_WEIGHT_TYPES, EngineConfig
from dflash2.fast.kernels.quant.layout import Q
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.fast.weights.dummy_quantized import quantizable
from dflash2.fast.weights.gguf_quantized import QuantParam
from dflash2.reference.formats.errors import ConfigError
from dflash2.reference.tiny.target import write_tiny_target


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("dq") / "t", "tiny-moe-256")


@pytest.mark.parametrize("qtype", ["Q4_K", "IQ3_XXS"])
def test_dummy_quantized_target_runs_on_its_blocks(folder, qtype):
    llm = LLM(str(folder), load_format="dummy", dummy_weight_type=qtype, dtype="float32", device="cpu")
    target = llm.engine.model.target
    gdn = next(layer for layer in target.layers if layer.layer_type == "linear_attention")
    assert isinstance(gdn.mixer.w_in, QuantParam) and gdn.mixer.w_in.weight.qtype == Q[qtype]
    assert isinstance(target.lm_head, QuantParam)  # the tied head: the embedding's blocks
    moe = target.layers[0].mlp
    assert moe.quantized and moe.experts.gate_up.qtype == Q[qtype]
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.error is None


def test_which_matrices_are_quantized():
    assert quantizable("layers.0.mlp.experts.gate_up_proj", (4, 48, 256), Q.Q4_K)
    assert not quantizable("layers.0.mlp.gate.weight", (4, 256), Q.Q4_K)  # the router stays F32
    assert not quantizable("layers.0.linear_attn.conv1d.weight", (80, 1, 4), Q.Q4_K)
    assert not quantizable("layers.0.mlp.down_proj.weight", (256, 24), Q.Q4_K)  # 24 inputs: no whole block
    assert quantizable("layers.0.mlp.down_proj.weight", (256, 96), Q.Q8_0)


def test_refusals(folder):
    with pytest.raises(ConfigError, match="dummy_weight_type"):
        EngineConfig(model_path=str(folder), dummy_weight_type="Q4_K")  # a real checkpoint: its own types
    with pytest.raises(ConfigError, match=r"dummy_weight_type=.?Q4_0.*expected None or one of"):
        EngineConfig(model_path=str(folder), load_format="dummy", dummy_weight_type="Q4_0")
    assert "IQ3_XXS" in DUMMY_WEIGHT_TYPES and "Q4_K" in DUMMY_WEIGHT_TYPES
