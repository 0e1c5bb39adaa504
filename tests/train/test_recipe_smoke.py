"""The whole training recipe for a few seconds on the CPU: corpus -> tokenizer -> target -> draft
(with the MTP fine-tune) -> refine (on target-generated text) -> evaluate -> export, through ``ft train``, on a tiny recipe
(``recipe.smoke_recipe``). What a real run does on the H200 at the default sizes, at toy scale:
every stage runs, writes real checkpoint folders the engine serves, resumes, and skips when done.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dflash2.cli.main import main as ft
from dflash2.train.corpus import build_corpus
from dflash2.train.corpus_sources import Source

CODE = textwrap.dedent('''
    def fib(n):
        """Return the n-th Fibonacci number."""
        a, b = 0, 1
        for _ in range(n):
            a, b = b, a + b
        return a


    class Stack:
        def __init__(self):
            self.items = []

        def push(self, item):
            self.items.append(item)

        def pop(self):
            return self.items.pop()
    ''')
DOCS = "The tutorial explains how a list can be used as a stack, where the last element added is the first retrieved.\n"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("recipe")
    src = root / "src"
    for i in range(40):
        (src / "lib").mkdir(parents=True, exist_ok=True)
        (src / "lib" / f"mod{i:02d}.py").write_text(CODE.replace("fib", f"fib{i}") * 3)
        (src / "doc").mkdir(exist_ok=True)
        (src / "doc" / f"page{i:02d}.txt").write_text(DOCS * 12)
    corpus = root / "corpus"
    build_corpus(corpus, sources=[Source("stdlib", src / "lib", "*.py"), Source("docs", src / "doc", "*.txt")],
                 heldout_percent=10)
    run = root / "run"
    assert ft(["train", "tokenizer", "--smoke", "--corpus", str(corpus), "--run", str(run)]) == 0
    for stage in ("target", "draft", "refine"):
        assert ft(["train", stage, "--corpus", str(corpus), "--run", str(run), "--device", "cpu"]) == 0
    return corpus, run


def test_stages_write_servable_checkpoints(smoke_run):
    from dflash2.fast.llm import LLM, SamplingParams

    corpus, run = smoke_run
    target_summary = json.loads((run / "target" / "done.json").read_text())
    assert target_summary["steps"] > 0 and target_summary["heldout_loss"] > 0
    assert "heldout_mtp_loss" in target_summary
    draft_summary = json.loads((run / "draft" / "done.json").read_text())
    assert draft_summary["steps"] > 0 and draft_summary["draft_parameters"] > 0
    refine_summary = json.loads((run / "refine" / "done.json").read_text())
    assert refine_summary["steps"] > 0
    rows = np.load(run / "generated.npy")  # prompt + generated tokens, one fixed length
    assert rows.ndim == 2 and rows.shape[0] > 0 and rows.shape[1] == 16 + 49
    for algorithm in ("none", "mtp", "dflash"):
        llm = LLM(run / "refine" / "target", device="cpu", speculative_algorithm=algorithm,
                  speculative_draft_model_path=run / "refine" / "model" if algorithm == "dflash" else None)
        out = llm.generate(["def fib(n):\n"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        assert out.error is None and len(out.token_ids) == 8


def test_target_loss_falls(smoke_run):
    _, run = smoke_run
    log = [json.loads(line) for line in (run / "target" / "log.jsonl").read_text().splitlines()]
    first, last = log[0]["loss"], log[-1]["loss"]
    assert last < first, (first, last)


def test_done_stage_is_skipped_and_state_resumes(smoke_run, capsys):
    corpus, run = smoke_run
    assert ft(["train", "target", "--corpus", str(corpus), "--run", str(run), "--device", "cpu"]) == 0
    assert "done earlier" in capsys.readouterr().out
    assert (run / "target" / "state.pt").exists()


def test_evaluate_and_export(smoke_run, tmp_path):
    corpus, run = smoke_run
    report_dir = tmp_path / "report"
    assert ft(["train", "evaluate", "--corpus", str(corpus), "--run", str(run), "--device", "cpu",
               "--eval-prompts", "1", "--eval-max-tokens", "8", "--report", str(report_dir)]) == 0
    report = json.loads((report_dir / "report.json").read_text())
    assert Path(report["pair"]) == run / "refine"
    greedy = report["results"]["greedy"]
    assert set(greedy) == {"off", "mtp3", "mtp7", "dflash3", "dflash7"}
    assert greedy["off"]["tokens_per_step"] is None and greedy["dflash7"]["tokens_per_step"] >= 1.0
    assert greedy["dflash7"]["greedy_equal_prompts"] == len(report["prompts"])  # fp32 CPU: exact
    out = tmp_path / "pair"
    assert ft(["train", "export", "--run", str(run), "--out", str(out)]) == 0
    assert (out / "target" / "config.json").exists() and (out / "draft" / "model.safetensors").exists()
    # An exported pair is judged and refined further by name (`--pair`), as the bundled one is.
    again = tmp_path / "again"
    assert ft(["train", "evaluate", "--corpus", str(corpus), "--run", str(run), "--device", "cpu", "--pair", str(out),
               "--eval-prompts", "1", "--eval-max-tokens", "4", "--eval-settings", "off,dflash3",
               "--eval-modes", "greedy", "--report", str(again)]) == 0
    assert Path(json.loads((again / "report.json").read_text())["pair"]) == out
    rerun = tmp_path / "rerun"
    rerun.mkdir()
    (rerun / "recipe.json").write_text((run / "recipe.json").read_text())
    (rerun / "tokenizer").symlink_to(run / "tokenizer")
    assert ft(["train", "refine", "--corpus", str(corpus), "--run", str(rerun), "--device", "cpu",
               "--pair", str(out), "--seconds", "1"]) == 0
    assert json.loads((rerun / "refine" / "done.json").read_text())["steps"] > 0
    assert not (rerun / "draft").exists()


def test_stage_order_errors_are_one_line(tmp_path, capsys):
    assert ft(["train", "export", "--run", str(tmp_path / "run")]) == 2
    assert "--out" in capsys.readouterr().err
    assert ft(["train", "export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "o")]) == 2
    assert "no finished draft stage" in capsys.readouterr().err
    assert ft(["train", "evaluate", "--run", str(tmp_path / "run"), "--pair", str(tmp_path)]) == 2
    assert "expected target/config.json" in capsys.readouterr().err
