"""``ft generate --engine fast`` (the default) prints the reference engine's JSON and writes its trace:
same keys, same tokens, text, finish reasons, verify steps and per-step records; only timings differ."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from dflash2.cli.main import main


def ft(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


def without_timing(obj: dict) -> dict:
    obj = {k: v for k, v in obj.items() if k != "timing"}
    obj["samples"] = [{k: v for k, v in s.items() if k != "timing"} for s in obj["samples"]]
    return obj


@pytest.mark.parametrize("algorithm, sampling", [
    ("none", ["--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]),
    ("dflash", ["--temperature", "0"]),
    ("mtp", ["--temperature", "1.0", "--top-k", "20", "--seed", "7"]),
])
def test_fast_and_reference_print_the_same_json_and_trace(tiny, tmp_path, algorithm, sampling):
    t = tiny("tiny-dense")
    spec = ["--speculative-algorithm", algorithm] + (["--speculative-draft-model-path", t.draft]
                                                     if algorithm == "dflash" else [])
    results = {}
    for engine in ("fast", "reference"):
        trace = tmp_path / f"{engine}.jsonl"
        code, out = ft("generate", "--model", t.target, "--engine", engine, "--prompt", "Hello there", "--chat",
                       "--max-tokens", "9", "--n", "3", "--json", "--trace", trace, "--cpu-cache-bytes", 8 << 20,
                       "--dtype", "float32", "--speculative-depth", "fixed", *sampling, *spec)
        assert code == 0
        results[engine] = (json.loads(out), trace.read_text().splitlines())
    (fast, fast_trace), (ref, ref_trace) = results["fast"], results["reference"]
    assert fast["engine"] == "fast" and ref["engine"] == "reference"
    fast["engine"] = "reference"
    assert without_timing(fast) == without_timing(ref)
    assert set(fast["timing"]) == set(ref["timing"])
    assert [json.loads(line) for line in fast_trace] == [json.loads(line) for line in ref_trace]
    assert (len(fast_trace) > 0) == (algorithm != "none")
