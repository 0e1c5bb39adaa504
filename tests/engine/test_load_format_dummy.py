"""``--load-format dummy``: random weights from config.json alone (reference/tiny/dummy.py), for timing at
real shapes. The config is validated exactly as for a real checkpoint; no safetensors are read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash2.cli.main import main
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.formats.config import load_target_config
from dflash2.reference.formats.draft_config import load_draft_config
from dflash2.reference.formats.errors import ConfigError
from dflash2.reference.formats.weights import expected_target_shapes
from dflash2.reference.tiny.dummy import dummy_draft_weights, dummy_target_weights
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target


@pytest.fixture(scope="module")
def configs_only(tmp_path_factory):
    """A tiny MoE target (with MTP head) and its draft with every tensor file removed."""
    root = tmp_path_factory.mktemp("dummy")
    target = write_tiny_target(root / "target", "tiny-moe")
    draft = write_tiny_draft(root / "draft", target)
    for folder in (target, draft):
        for file in folder.glob("*.safetensors*"):
            file.unlink()
    return target, draft


def test_dummy_weights_have_the_canonical_shapes_and_are_a_function_of_seed_and_name(configs_only):
    target, draft = configs_only
    cfg = load_target_config(target)
    first, again = dummy_target_weights(cfg, seed=3), dummy_target_weights(cfg, seed=3)
    other = dummy_target_weights(cfg, seed=4)
    assert {n: tuple(s) for n, s in expected_target_shapes(cfg).items()} == \
        {n: tuple(first[n].shape) for n in first}
    name = "layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(first[name], again[name]) and not torch.equal(first[name], other[name])
    assert first["layers.0.linear_attn.A_log"].dtype == torch.float32  # kept fp32, as releases store it
    assert first[name].dtype == torch.bfloat16
    assert all(torch.isfinite(first[n].float()).all() for n in first)
    draft_cfg = load_draft_config(draft, cfg)
    draft_weights = dummy_draft_weights(draft_cfg, seed=1)
    assert set(draft_weights) and all(torch.isfinite(draft_weights[n].float()).all() for n in draft_weights)


def test_membership_and_type_tests_draw_nothing(configs_only, monkeypatch):
    """``name in weights`` and ``Params.is_quantized`` read the shapes only: drawing a 35B-A3B layer's 1 GiB expert
    tensors just to test them left their blocks in the CUDA allocator, layer after layer, until an H100's load ran
    out of memory (bench/results/2026-12-07c-h100-open-figures)."""
    from dflash2.fast.model.params import Params
    cfg = load_target_config(configs_only[0])
    weights = dummy_target_weights(cfg, seed=3)
    drawn = []
    monkeypatch.setattr(weights, "init", lambda name, *rest: drawn.append(name))
    name = "layers.0.mlp.experts.gate_up_proj"
    assert name in weights and "layers.0.no_such.weight" not in weights
    assert not Params(cfg, weights, torch.float32, "cpu").is_quantized(name)
    assert drawn == []


@pytest.mark.parametrize("algorithm", ["none", "mtp", "dflash"])
def test_the_engine_runs_on_dummy_weights_and_repeats_itself(configs_only, algorithm):
    target, draft = configs_only
    kwargs = dict(dtype=torch.float32, max_running_req=2, load_format="dummy", speculative_algorithm=algorithm,
                  speculative_draft_model_path=draft if algorithm == "dflash" else None)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = [LLM(target, **kwargs).generate([[1, 2, 3]], params)[0] for _ in range(2)]
    assert outs[0].error is None and len(outs[0].token_ids) == 10
    assert outs[0].token_ids == outs[1].token_ids  # same seed, same dummy weights, same tokens


def test_dummy_still_validates_the_config(configs_only, tmp_path):
    target, _ = configs_only
    broken = tmp_path / "broken"
    shutil.copytree(target, broken)
    raw = json.loads((broken / "config.json").read_text())
    (raw.get("text_config") or raw)["num_hidden_layers"] = 0
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        LLM(broken, dtype=torch.float32, load_format="dummy")
    with pytest.raises(ConfigError, match="load_format"):
        LLM(target, dtype=torch.float32, load_format="random")


def test_the_reference_engine_refuses_dummy(configs_only, capsys):
    target, _ = configs_only
    code = main(["generate", "--model", str(target), "--engine", "reference", "--prompt-ids", "1,2",
                 "--load-format", "dummy"])
    assert code == 2
    assert "load_format='dummy'" in capsys.readouterr().err
