"""Finish conditions inside a batch, as the reference: a stop id (kept, unless ignore_eos), a stop string
(the text cut before it, the ids kept), max_tokens, and the engine's max_model_len (reason "length")."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2.fast.llm import LLM
from dflash2.reference.runner import ReferenceRunner
from dflash2.reference.request.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 3]


@pytest.mark.parametrize("algorithm", ["none", "mtp"])
def test_stop_id_and_stop_string_in_one_batch(tiny, tmp_path, algorithm):
    t = tiny("tiny-dense")
    free = ReferenceRunner(t.target).generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop_id = free.token_ids[4]  # make the fifth greedy token an eos id
    assert stop_id not in free.token_ids[:4]
    target = tmp_path / "target"
    shutil.copytree(t.target, target)
    generation = json.loads((target / "generation_config.json").read_text())
    generation["eos_token_id"] = [stop_id]
    (target / "generation_config.json").write_text(json.dumps(generation))
    stop_text = free.text[len(free.text) // 2:][:3]
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop_text,)),
              SamplingParams(max_tokens=3, temperature=0)]
    llm = LLM(target, dtype="float32", speculative_algorithm=algorithm, max_running_req=2, page_size=4,
              cpu_cache_bytes=2 << 20)
    runner = ReferenceRunner(target, speculative_algorithm=algorithm)
    outputs = llm.generate([PROMPT] * len(params), params)
    for sp, out in zip(params, outputs):
        ref = runner.generate(PROMPT, sp)
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    assert outputs[0].token_ids == free.token_ids[:5] and outputs[0].finish_reason == "stop"
    assert outputs[1].token_ids == free.token_ids and outputs[1].finish_reason == "length"
    assert outputs[2].finish_reason == "stop" and stop_text not in outputs[2].text
    assert outputs[3].token_ids == free.token_ids[:3] and outputs[3].finish_reason == "length"


@pytest.mark.parametrize("algorithm", ["none", "dflash"])
def test_max_model_len_ends_a_request_like_max_tokens(tiny, reference_runner, algorithm):
    t = tiny("tiny-moe")
    llm = LLM(t.target, dtype="float32", speculative_algorithm=algorithm,
              speculative_draft_model_path=t.draft if algorithm == "dflash" else None, max_model_len=12,
              max_running_req=2, page_size=4, cpu_cache_bytes=4 << 20)
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=1, ignore_eos=True)
    long_prompt = list(range(12))
    out, refused = llm.generate([PROMPT, long_prompt], params)
    ref = reference_runner("tiny-moe", algorithm).generate(PROMPT, SamplingParams(
        max_tokens=12 - len(PROMPT), temperature=0.9, seed=1, ignore_eos=True))
    assert (out.token_ids, out.finish_reason) == (ref.token_ids, "length")
    assert refused.finish_reason == "error" and "max_model_len=12" in refused.error
