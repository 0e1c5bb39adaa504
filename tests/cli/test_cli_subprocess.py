"""The installed ``ft`` console script and ``python -m dflash2.cli`` as a user runs them: real exit
codes, one-line errors with no traceback, JSON on stdout. Kept to a few processes, run concurrently:
each spends ~2 s of CPU importing torch and transformers (the in-process tests cover the rest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

FT = str(Path(sys.executable).parent / "ft")
MISSING_TENSOR = "model.language_model.layers.2.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def results(made, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("subprocess")
    dense = made("tiny-dense")
    broken = root / "broken"
    broken.mkdir()
    for file in dense.target.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors[MISSING_TENSOR]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    prompt = ["--prompt-ids", "5,17,42,99,3"]
    commands = {
        "help": [sys.executable, "-m", "dflash2.cli", "--help"],
        "greedy": [FT, "generate", "--model", str(dense.target), *prompt, "--temperature", "0", "--max-tokens", "6",
                   "--ignore-eos", "--json", "--speculative-algorithm", "dflash",
                   "--speculative-draft-model-path", str(dense.draft)],
        "missing_tensor": [FT, "generate", "--model", str(broken), *prompt],
        "bad_top_p": [sys.executable, "-m", "dflash2.cli", "generate", "--model", str(dense.target), *prompt,
                      "--top-p", "1.5"],
        "argparse": [FT, "generate", "--model", str(dense.target), "--prompt-ids", "1,x"],
    }
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name, cmd in commands.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(commands[name], proc.returncode, stdout, stderr)
    return out


def test_python_m_help(results):
    r = results["help"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ft") and "generate" in r.stdout and "make-tiny" in r.stdout


def test_console_script_generates_json(results, made, ft, greedy_args):
    r = results["greedy"]
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 6
    # the same tokens as the in-process call, and as plain greedy decoding
    assert out["token_ids"] == ft(*greedy_args(made("tiny-dense").target, max_tokens=6)).json()["token_ids"]


@pytest.mark.parametrize("name, needles", [
    ("missing_tensor", ["missing tensor", repr(MISSING_TENSOR)]),
    ("bad_top_p", ["top_p=1.5"]),
])
def test_user_error_exits_2_with_one_line(results, name, needles):
    r = results[name]
    assert r.returncode == 2
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ft generate: error: ")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_argparse_error_exits_2_without_traceback(results):
    r = results["argparse"]
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("usage: ft generate")
    last = r.stderr.splitlines()[-1]
    assert last.startswith("ft generate: error: argument --prompt-ids") and "'1,x'" in last
