"""``ft make-tiny`` writes, for every preset, a folder ``ft generate`` runs on, and a draft
``--speculative-algorithm dflash`` accepts (issue #2: the whole path from a checkpoint folder to tokens)."""

from __future__ import annotations

import json

import pytest

from dflash2.reference.tiny.target import PRESETS

# the real-vocabulary preset (248320 ids, 30 MB with its draft) is the slow one: ~6 s to write and run
# once, so it runs once (the first test below) and nowhere else
FAST_PRESETS = sorted(p for p in PRESETS if p != "tiny-dense-qwen-vocab")


def test_presets_are_the_ones_this_suite_covers():
    assert set(PRESETS) == {*FAST_PRESETS, "tiny-dense-qwen-vocab"}
    assert {"tiny-dense", "tiny-moe"} <= set(FAST_PRESETS)


@pytest.mark.parametrize("preset", [*FAST_PRESETS, "tiny-dense-qwen-vocab"])
def test_make_tiny_writes_a_folder_that_generate_runs_on(made, ft, preset):
    m = made(preset)
    assert f"wrote {preset} to {m.target}" in m.printed
    assert f"wrote a DFlash 2 draft for it to {m.draft}" in m.printed
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (m.target / name).is_file(), name
    assert list(m.target.glob("*.safetensors"))
    assert (m.draft / "config.json").is_file() and (m.draft / "model.safetensors").is_file()

    # text in, text out: the folder's own tokenizer and chat template serve a plain generate
    run = ft("generate", "--model", m.target, "--chat", "--prompt", "Hello", "--max-tokens", "4", "--seed", "1",
             "--json")
    out = run.json()
    assert run.err == ""
    assert 1 <= len(out["token_ids"]) <= 4 and out["finish_reason"] in ("length", "stop")
    vocab = json.loads((m.target / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    assert all(0 <= t < vocab for t in out["prompt_token_ids"] + out["token_ids"])
    assert isinstance(out["text"], str)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-moe-text"])
def test_make_tiny_draft_is_accepted_by_dflash(made, ft, greedy_args, preset):
    m = made(preset)
    run = ft(*greedy_args(m.target, max_tokens=6), "--speculative-algorithm", "dflash",
             "--speculative-draft-model-path", m.draft)
    out = run.json()
    assert out["speculative_algorithm"] == "dflash"
    assert out["num_steps"] == json.loads((m.draft / "config.json").read_text())["dflash_config"]["block_size"] - 1
    assert len(out["token_ids"]) == 6 and out["samples"][0]["verify_steps"] >= 1


def test_make_tiny_seed_changes_the_weights(ft, tmp_path, greedy_args):
    """--seed overrides the preset's weight seed: same seed, same bytes; another seed, another model."""
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        assert ft("make-tiny", "--preset", "tiny-dense-text", "--out", tmp_path / name, "--seed", seed).code == 0
    files = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert files
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    tokens = {name: ft(*greedy_args(tmp_path / name)).json()["token_ids"] for name in "ac"}
    assert tokens["a"] != tokens["c"]


def test_make_tiny_refuses_an_unknown_preset(ft):
    with pytest.raises(SystemExit) as exc:  # argparse's choices: exit status 2 with the valid names
        ft("make-tiny", "--preset", "tiny-huge", "--out", "unused")
    assert exc.value.code == 2


def test_help_lists_every_preset_and_flag(capsys):
    from dflash2.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["make-tiny", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert all(preset in text for preset in PRESETS)
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--engine", "--prompt-ids", "--chat", "--max-tokens", "--temperature", "--top-p",
                 "--top-k", "--seed", "--stop", "--ignore-eos", "--json", "--n", "--speculative-algorithm",
                 "--speculative-draft-model-path", "--speculative-num-steps", "--trace"):
        assert flag in text, flag
