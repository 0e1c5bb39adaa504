"""The bundled trained pair (models/pycoder-10m) through both engines: the same tokens, verify steps
and per-step records as the fp32 reference, for plain, MTP and DFlash decoding, greedy and sampled.

The tiny random checkpoints of the other token tests accept almost nothing; these weights were
trained, so drafts are accepted several at a time and the verify paths run their long-prefix cases
on realistic distributions (peaked, with near ties a random model rarely makes). On the CPU, where
fp32 is held token for token; the GPU lane's token tests cover the CUDA kernels on the tiny models.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from dflash2.cli.main import main

PROMPT = 'import os\n\n\ndef walk(root):\n    """Yield every file under root."""\n'


def ft(*argv) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(a) for a in argv]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("algorithm, sampling", [
    ("none", ["--temperature", "0"]),
    ("dflash", ["--temperature", "0"]),
    ("mtp", ["--temperature", "0"]),
    ("dflash", ["--temperature", "1.0", "--top-p", "0.95", "--seed", "3"]),
    ("mtp", ["--temperature", "0.7", "--top-k", "20", "--seed", "4"]),
])
def test_bundled_pair_fast_equals_reference(algorithm, sampling):
    results = {engine: ft("generate", "--engine", engine, "--prompt", PROMPT, "--max-tokens", "24", "--ignore-eos",
                          "--json", "--dtype", "float32", "--device", "cpu", "--speculative-algorithm", algorithm, *sampling,
                          "--speculative-depth", "fixed")  # sampled tokens compared exactly: k every step
               for engine in ("fast", "reference")}
    fast, ref = results["fast"], results["reference"]
    assert fast["token_ids"] == ref["token_ids"] and len(fast["token_ids"]) == 24
    assert [s.get("verify_steps") for s in fast["samples"]] == [s.get("verify_steps") for s in ref["samples"]]
    if algorithm != "none" and sampling[1] == "0":  # trained drafts are accepted: more than one token a step
        assert fast["samples"][0]["tokens_per_step"] > 1.5
