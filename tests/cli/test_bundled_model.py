"""The bundled trained pair: the default of ft generate, ft serve and LLM(), within its size budget."""

from __future__ import annotations

import json

import pytest

from dflash2 import models
from dflash2.fast.cli import main as ft
from dflash2.reference.formats.errors import UserInputError

MiB = 2**20


def test_bundled_pair_fits_its_budget_and_loads():
    from dflash2.reference.formats.checkpoint import load_target
    from dflash2.reference.formats.draft_checkpoint import load_draft

    folder = models.ROOT / models.DEFAULT_NAME
    files = [f for f in folder.rglob("*") if f.is_file()]
    assert (folder / "MODEL_CARD.md").exists()
    assert all(f.stat().st_size <= 16 * MiB for f in files), [(f.name, f.stat().st_size) for f in files]
    assert sum(f.stat().st_size for f in files) <= 32 * MiB
    cfg, _ = load_target(models.bundled_target(), dtype=None)
    load_draft(models.bundled_draft(), cfg)


def test_resolve_model_paths():
    target, draft = models.resolve_model_paths(None, "dflash", None)
    assert (target, draft) == (str(models.bundled_target()), str(models.bundled_draft()))
    assert models.resolve_model_paths(None, "mtp", None) == (str(models.bundled_target()), None)
    assert models.resolve_model_paths("m", "dflash", None) == ("m", None)  # never guess a draft for a named model


def test_missing_bundle_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "ROOT", tmp_path)
    with pytest.raises(UserInputError, match="bundled default is missing"):
        models.resolve_model_paths(None, "none", None)


def test_ft_generate_without_model_runs_the_bundled_pair(capsys):
    assert ft(["generate", "--prompt", "def add(a, b):\n", "--max-tokens", "12", "--temperature", "0",
               "--ignore-eos", "--speculative-algorithm", "dflash", "--json", "--compare-plain"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 12 and out["num_steps"] == 7
    comparison = out["comparison"]
    assert comparison["outputs_equal"] is True and comparison["tokens_per_step"] >= 1.0
    assert comparison["speedup"] > 0


def test_compare_plain_needs_a_speculative_algorithm(capsys):
    assert ft(["generate", "--prompt", "x", "--compare-plain"]) == 2
    assert "compare_plain" in capsys.readouterr().err


def test_llm_default():
    from dflash2.fast.llm import LLM, SamplingParams

    llm = LLM(device="cpu")
    assert llm.config.model_path == str(models.bundled_target())
    out = llm.generate(["import os\n"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.error is None and len(out.token_ids) == 4
