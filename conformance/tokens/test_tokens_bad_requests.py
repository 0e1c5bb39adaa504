"""A bad request fails alone: its RequestOutput carries the reference's error and no tokens, while the
requests batched with it finish exactly as they would without it."""

from __future__ import annotations

import pytest

from dflash2.fast.llm import LLM
from dflash2.reference.formats.errors import RequestError
from dflash2.reference.request.sampling_params import SamplingParams

GOOD = [([5, 17, 42, 99, 3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
        (list(range(30, 50)), SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=9, ignore_eos=True))]


def reference_error(runner, prompt, params) -> str:
    with pytest.raises(RequestError) as exc:
        runner.generate(prompt, params)
    return str(exc.value)


@pytest.mark.parametrize("algorithm", ["none", "dflash"])
def test_bad_requests_fail_alone(tiny, reference_runner, algorithm):
    t = tiny("tiny-dense")
    llm = LLM(t.target, dtype="float32", speculative_algorithm=algorithm,
              speculative_draft_model_path=t.draft if algorithm == "dflash" else None, max_running_req=2,
              page_size=4, cpu_cache_bytes=4 << 20)
    runner = reference_runner("tiny-dense", algorithm)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    bad = [
        ([5, 512, 7], greedy, reference_error(runner, [5, 512, 7], greedy)),
        ([], greedy, reference_error(runner, [], greedy)),
        ([1, 2], SamplingParams(max_tokens=40000), reference_error(runner, [1, 2], SamplingParams(max_tokens=40000))),
        ([1, 2], {"temperature": -1.0}, "temperature=-1.0"),
        ([1, 2], {"temprature": 0.5}, "temprature"),
        ([1, True], greedy, "prompt token ids [True]"),
        ("", greedy, reference_error(runner, [], greedy)),
        ([1, 2], "greedy", "expected a SamplingParams"),
    ]
    prompts = [GOOD[0][0]] + [b[0] for b in bad] + [GOOD[1][0]]
    params = [GOOD[0][1]] + [b[1] for b in bad] + [GOOD[1][1]]
    outputs = llm.generate(prompts, params)
    alone = llm.generate([g[0] for g in GOOD], [g[1] for g in GOOD])
    for out, (_, _, needle) in zip(outputs[1:-1], bad):
        assert out.finish_reason == "error" and out.token_ids == [] and needle in out.error, (out.error, needle)
    for out, single in zip([outputs[0], outputs[-1]], alone):
        assert out.error is None and out.token_ids == single.token_ids and out.finish_reason == single.finish_reason
        assert len(out.token_ids) > 0


def test_request_larger_than_the_cache_fails_alone(tiny):
    t = tiny("tiny-dense")
    llm = LLM(t.target, device="cpu", max_running_req=2, page_size=4, cpu_cache_bytes=64 << 10)
    pages = llm.engine.model.memory.num_pages
    too_long = SamplingParams(max_tokens=pages * 4, temperature=0, ignore_eos=True)
    outputs = llm.generate([[1, 2, 3], [4, 5, 6]], [too_long, GOOD[0][1]])
    assert outputs[0].finish_reason == "error" and f"the {pages} pages the cache holds" in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].token_ids) == 8
