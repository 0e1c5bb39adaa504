"""The bundled trained pair: the default of ft generate, ft serve and LLM(), within its size budget."""

from __future__ import annotations

import json

import pytest

from dflash2 import models
from dflash2.cli.main import main as ft
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


def test_a_pair_folder_is_taken_as_its_target_and_draft(capsys):
    """``--model models/pycoder-10m`` (the folder the README names) runs its target, and its draft with dflash."""
    folder = models.ROOT / models.DEFAULT_NAME
    assert models.resolve_model_paths(folder, "dflash", None) == (str(folder / "target"), str(folder / "draft"))
    assert models.resolve_model_paths(folder, "mtp", None) == (str(folder / "target"), None)
    assert models.resolve_model_paths(folder, "dflash", "d") == (str(folder / "target"), "d")
    assert ft(["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--temperature",
               "0", "--speculative-algorithm", "dflash", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_steps"] == 7


def test_text_output_says_that_speculation_ran(capsys):
    """Text mode prints the completion on stdout and one stderr line with the tokens per verify step."""
    assert ft(["generate", "--prompt", "def f(x):\n", "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
               "--speculative-algorithm", "dflash"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash k=7: ") and "tokens per verify step" in err[0], err
    assert ft(["generate", "--prompt", "def f(x):\n", "--max-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().err == ""


def test_serve_without_a_model_serves_the_bundled_pair_with_its_draft(monkeypatch):
    """``ft serve`` with no model: the bundled pair with DFlash (its log says so); ``--speculative-algorithm none``
    serves it plainly; a named model is served as asked. ``run_serve`` is replaced: no server starts."""
    import dflash2.fast.serve.server as server

    seen = []
    monkeypatch.setattr(server, "run_serve", lambda config, settings, model_given=None: seen.append(config) or 0)
    assert ft(["serve"]) == 0
    assert ft(["serve", "--speculative-algorithm", "none"]) == 0
    assert ft(["serve", "--model", str(models.bundled_target())]) == 0
    assert [c.speculative_algorithm for c in seen] == ["dflash", "none", "none"]
    assert seen[0].speculative_draft_model_path == str(models.bundled_draft())
