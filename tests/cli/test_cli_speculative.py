"""``ft generate --speculative-algorithm mtp|dflash``: greedy output equals plain decoding through the
command line, and ``--trace`` writes one consistent JSON line per verify step (issue #3)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

TRACE_KEYS = {"sample", "step", "anchor_position", "draft_tokens", "cand_ids", "q", "target_tokens",
              "num_accepted", "emitted"}


def spec_args(made, preset: str, algorithm: str, *extra) -> list:
    args = ["--speculative-algorithm", algorithm, *extra]
    if algorithm == "dflash":
        args += ["--speculative-draft-model-path", made(preset).draft]
    return args


def read_trace(path) -> list[dict]:
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines]


def check_trace(steps: list[dict], out: dict, prompt_len: int) -> None:
    """Every line well formed; per sample, the steps chain and their ``emitted`` rebuild the output."""
    assert steps, "a speculative run verifies at least once"
    for sample in out["samples"]:
        mine = [s for s in steps if s["sample"] == sample["index"]]
        assert [s["step"] for s in mine] == list(range(len(mine)))
        assert sample["verify_steps"] == len(mine)
        assert sample["tokens_per_step"] == pytest.approx(sum(len(s["emitted"]) for s in mine) / len(mine))
        tokens = sample["token_ids"]
        position = prompt_len  # the first token (from the prefill) is the first anchor
        anchor = tokens[0]
        for s in mine:
            assert set(s) == TRACE_KEYS
            k = len(s["draft_tokens"])
            assert k >= 1 or s is mine[-1]  # only the last step, with one token left, drafts nothing
            assert len(s["cand_ids"]) == k and len(s["q"]) == k
            assert all(len(c) == len(q) >= 1 for c, q in zip(s["cand_ids"], s["q"]))
            assert all(q_i == pytest.approx(1.0, abs=1e-5) for q_i in map(sum, s["q"]))
            assert all(y in c for y, c in zip(s["draft_tokens"], s["cand_ids"]))
            assert len(s["target_tokens"]) == k + 1
            assert 0 <= s["num_accepted"] <= k
            assert len(s["emitted"]) == s["num_accepted"] + 1
            assert s["emitted"][:-1] == s["draft_tokens"][:s["num_accepted"]]  # accepted drafts kept as drafted
            assert s["anchor_position"] == position
            position += len(s["emitted"])
            anchor = s["emitted"][-1]
        assert anchor == tokens[-1]
        assert sum((s["emitted"] for s in mine), []) == tokens[1:]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_greedy_speculative_equals_plain_and_traces_every_step(made, ft, greedy_args, tmp_path, preset):
    path = made(preset).target
    plain = ft(*greedy_args(path, max_tokens=12)).json()
    assert plain["speculative_algorithm"] == "none" and plain["num_steps"] is None
    assert "verify_steps" not in plain["samples"][0]
    for algorithm, steps in (("mtp", None), ("mtp", "1"), ("dflash", None), ("dflash", "3")):
        extra = ["--speculative-num-steps", steps] if steps else []
        trace = tmp_path / f"{algorithm}-{steps}.jsonl"
        out = ft(*greedy_args(path, max_tokens=12), *spec_args(made, preset, algorithm, *extra),
                 "--trace", trace).json()
        assert out["token_ids"] == plain["token_ids"], (algorithm, steps)
        assert out["speculative_algorithm"] == algorithm
        assert out["num_steps"] == (int(steps) if steps else {"mtp": 3, "dflash": 7}[algorithm])
        records = read_trace(trace)
        check_trace(records, out, prompt_len=5)
        assert max(len(r["draft_tokens"]) for r in records) == out["num_steps"]
        for r in records:  # greedy: the target's argmax rows are what verify emits
            assert r["emitted"] == r["target_tokens"][:len(r["emitted"])]
            if algorithm == "mtp":  # deterministic drafts: q is one-hot on the draft
                assert r["q"] == [[1.0]] * len(r["draft_tokens"])


def test_sampled_dflash_trace_with_several_samples(made, ft, tmp_path):
    """Sampled verification (q from the selector's softmax) and --n: each sample's lines rebuild it."""
    m = made("tiny-dense")
    trace = tmp_path / "sampled.jsonl"
    args = ["generate", "--model", m.target, "--prompt-ids", "5,17,42,99,3", "--temperature", "0.8", "--top-k", "20",
            "--top-p", "0.9", "--max-tokens", "16", "--ignore-eos", "--json", "--seed", "3", "--n", "2",
            "--speculative-algorithm", "dflash", "--speculative-draft-model-path", m.draft, "--trace", trace,
            "--speculative-depth", "fixed"]
    out = ft(*args).json()
    records = read_trace(trace)
    assert {r["sample"] for r in records} == {0, 1}
    check_trace(records, out, prompt_len=5)
    assert any(max(q) < 1.0 for r in records for q in r["q"])  # a real distribution, not a one-hot
    again = ft(*args).json()
    assert [s["token_ids"] for s in again["samples"]] == [s["token_ids"] for s in out["samples"]]


def test_trace_is_empty_without_speculation(made, ft, greedy_args, tmp_path):
    trace = tmp_path / "none.jsonl"
    assert ft(*greedy_args(made("tiny-dense").target), "--trace", trace).code == 0
    assert trace.read_text() == ""


# --- full acceptance: a target whose final norms zero the hidden state ---------------------------


@pytest.fixture(scope="module")
def constant_target(made, tmp_path_factory):
    """tiny-dense with ``norm.weight = mtp.norm.weight = -1`` (zero-centred: scale 1 + w = 0): every
    logit of the target and of its MTP head is 0, so both argmax to token 0 and MTP drafts are
    always accepted; the plain greedy output is all zeros."""
    path = tmp_path_factory.mktemp("constant") / "target"
    shutil.copytree(made("tiny-dense").target, path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in ("model.language_model.norm.weight", "mtp.norm.weight"):
        tensors[name] = -tensors[name].new_ones(tensors[name].shape)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("max_tokens", [5, 9])
def test_mtp_full_acceptance(ft, greedy_args, constant_target, tmp_path, max_tokens):
    """max_tokens - 1 a multiple of k + 1 = 4: every step accepts all k drafts and adds the bonus."""
    plain = ft(*greedy_args(constant_target, max_tokens=max_tokens)).json()
    assert plain["token_ids"] == [0] * max_tokens
    trace = tmp_path / "full.jsonl"
    out = ft(*greedy_args(constant_target, max_tokens=max_tokens), "--speculative-algorithm", "mtp",
             "--trace", trace).json()
    assert out["token_ids"] == plain["token_ids"]
    records = read_trace(trace)
    assert [r["num_accepted"] for r in records] == [3] * ((max_tokens - 1) // 4)
    assert out["samples"][0]["tokens_per_step"] == 4.0
    check_trace(records, out, prompt_len=5)


@pytest.mark.parametrize("max_tokens", [4, 7])
def test_mtp_full_acceptance_at_the_request_end(ft, greedy_args, constant_target, tmp_path, max_tokens):
    trace = tmp_path / "end.jsonl"
    out = ft(*greedy_args(constant_target, max_tokens=max_tokens), "--speculative-algorithm", "mtp",
             "--trace", trace).json()
    assert out["token_ids"] == [0] * max_tokens  # the output itself is right
    check_trace(read_trace(trace), out, prompt_len=5)
