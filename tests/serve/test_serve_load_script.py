"""``bench/load_serve.py`` against a live server: it counts what it sent, reads the server's counters,
reports percentiles, and refuses a target that is not on this machine."""

from __future__ import annotations

import json

import pytest

from dflash2.bench import load_serve


def test_the_load_script_reports_a_bounded_run(spec, tmp_path, capsys):
    out = tmp_path / "load.json"
    code = load_serve.main(["--url", spec.url, "--num-requests", "12", "--concurrency", "4", "--input-len", "9",
                            "--output-len", "6", "--duration-s", "30", "--timeout-s", "30", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())["levels"][0]
    assert result["num_ok"] == result["num_requests_sent"] == 12 and result["output_tokens"] == 72
    assert result["ttft_s"]["n"] == 12 and result["e2e_s"]["p50"] <= result["e2e_s"]["p99"]
    assert result["server"]["generation_tokens"] == 72 and result["server"]["prompt_tokens"] == 108
    assert result["server"]["tokens_per_verify_step"] >= 1
    assert "output tok/s" in capsys.readouterr().out
    assert spec.settle().idle


def test_levels_of_concurrency_beside_plain_decoding(spec, plain, tmp_path, capsys):
    """--concurrency 1,3 runs each level in turn; --plain-url runs them again on plain decoding, and the report
    gives each level's tokens per second beside plain's. Text prompts (--prompts) go through the tokenizer."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def f(x):", "class A:"]}))
    out = tmp_path / "levels.json"
    code = load_serve.main(["--url", spec.url, "--plain-url", plain.url, "--num-requests", "3", "--concurrency",
                            "1,3", "--output-len", "5", "--prompts", str(prompts), "--duration-s", "30",
                            "--timeout-s", "30", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["levels"]] == [1, 3] == [r["concurrency"] for r in result["plain_levels"]]
    for r in result["levels"] + result["plain_levels"]:
        assert r["num_ok"] == 3 and r["output_tokens"] == 15 and 0 < r["server"]["prompt_tokens"] < 3 * 16
    assert result["levels"][0]["server"]["verify_steps"] > 0 and result["plain_levels"][0]["server"]["verify_steps"] == 0
    text = capsys.readouterr().out
    assert "| concurrency | output tok/s | plain tok/s | vs plain |" in text and "| 3 |" in text
    assert spec.settle().idle and plain.settle().idle


def test_plain_serve_arguments_drop_the_speculative_flags():
    args = ["--model", "m", "--speculative-algorithm", "dflash", "--speculative-draft-model-path", "d",
            "--speculative-num-steps=3", "--speculative-depth", "fixed", "--max-running-req", "8"]
    assert load_serve.plain_serve_args(args) == ["--model", "m", "--max-running-req", "8",
                                                 "--speculative-algorithm", "none"]
    with pytest.raises(SystemExit):
        load_serve.main(["--concurrency", "4,0", "--url", "http://127.0.0.1:1"])


def test_the_load_script_only_targets_loopback():
    for url in ("http://10.0.0.1:8000", "http://example.com:8000", "http://192.168.1.2"):
        with pytest.raises(SystemExit, match="loopback"):
            load_serve.main(["--url", url, "--num-requests", "1"])


def test_percentiles_interpolate_between_ranks():
    p = load_serve.percentiles([4.0, 1.0, 3.0, 2.0])
    assert (p["p50"], p["mean"], p["n"]) == (2.5, 2.5, 4) and p["p99"] == pytest.approx(3.97)
    assert load_serve.percentiles([])["p50"] is None
