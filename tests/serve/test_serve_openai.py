"""The real ``openai`` client against a live server with DFlash speculative decoding: streaming equals
non-streaming, greedy and seeded output equal ``ft generate``, 16 concurrent streams complete, 100
disconnects leak nothing, the metrics move, ``/health`` answers during a long step, and an error in
one request fails that request alone."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dflash2.cli.main import main as ft_main
from dflash2.fast.engine import engine as engine_module
from dflash2.reference.request.stopping import Stopper

from serve_harness import MODEL

PROMPT_IDS = [5, 17, 42, 99, 3]


def ft_generate(*argv) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ft_main(["generate", *map(str, argv), "--json"]) == 0
    return json.loads(out.getvalue())


def chat_stream(client, **kw) -> dict:
    """A streamed chat completion folded into the non-streamed shape, per choice index."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "finish_reason": None, "logprobs": [], "token_ids": []})
            got["content"] += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                got["logprobs"] += [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                    for t in c.logprobs.content]
            got["token_ids"] += (c.model_extra or {}).get("token_ids") or []
            if c.finish_reason is not None:
                got["finish_reason"] = c.finish_reason
    return {"choices": choices, "usage": usage}


def chat_once(client, **kw) -> dict:
    response = client.chat.completions.create(model=MODEL, **kw)
    choices = {}
    for c in response.choices:
        logprobs = [] if c.logprobs is None else [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                                   for t in c.logprobs.content]
        choices[c.index] = {"content": c.message.content, "finish_reason": c.finish_reason, "logprobs": logprobs,
                            "token_ids": (c.model_extra or {}).get("token_ids") or []}
    return {"choices": choices, "usage": response.usage}


def test_models_and_health(spec):
    models = spec.client().models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == 256
    assert spec.http().get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_p=0.95, seed=7)])
def test_streaming_equals_non_streaming(spec, sampling):
    client = spec.client()
    messages = [{"role": "user", "content": "Tell me a story"}]
    kw = dict(messages=messages, max_tokens=24, n=2, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True, "return_token_ids": True}, **sampling)
    once, streamed = chat_once(client, **kw), chat_stream(client, **kw)
    assert once["choices"] == streamed["choices"]
    assert once["usage"] == streamed["usage"] and once["usage"].completion_tokens == 48
    for choice in once["choices"].values():
        assert len(choice["token_ids"]) == len(choice["logprobs"]) == 24 and choice["finish_reason"] == "length"
    first, second = once["choices"][0], once["choices"][1]
    if sampling["temperature"] == 0:  # the same tokens; logprobs equal up to the batch rows' rounding
        assert (first["content"], first["token_ids"]) == (second["content"], second["token_ids"])
        assert max(abs(a[1] - b[1]) for a, b in zip(first["logprobs"], second["logprobs"])) < 1e-4
    else:  # choice j draws with derive_seed(seed, j)
        assert first["token_ids"] != second["token_ids"]


def test_streaming_equals_non_streaming_with_a_stop_string(spec):
    client = spec.client()
    base = dict(messages=[{"role": "user", "content": "Hello"}], max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True})
    text = chat_once(client, **base)["choices"][0]["content"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3
    once, streamed = chat_once(client, stop=[stop], **base), chat_stream(client, stop=[stop], **base)
    assert once["choices"] == streamed["choices"]
    assert once["choices"][0]["content"] == text[:text.index(stop)]
    assert once["choices"][0]["finish_reason"] == "stop"


def test_completions_stream_equals_non_streaming_for_a_batch_of_prompts(spec):
    client = spec.client()
    kw = dict(model=MODEL, prompt=[PROMPT_IDS, [7, 8, 9, 10]], max_tokens=10, temperature=0.8, seed=3, n=2,
              logprobs=2, extra_body={"ignore_eos": True})
    once = client.completions.create(**kw)
    streamed: dict[int, dict] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got = streamed.setdefault(c.index, {"text": "", "tokens": [], "values": []})
            got["text"] += c.text
            if c.logprobs is not None:
                got["tokens"] += c.logprobs.tokens
                got["values"] += c.logprobs.token_logprobs
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in once.choices:
        assert streamed[c.index] == {"text": c.text, "tokens": c.logprobs.tokens, "values": c.logprobs.token_logprobs}
        assert c.finish_reason == "length" and len(c.logprobs.tokens) == 10
    assert once.usage.prompt_tokens == 9 and once.usage.completion_tokens == 40


def test_greedy_output_equals_ft_generate(spec, tiny):
    spec_flags = ["--model", tiny.target, "--speculative-algorithm", "dflash", "--speculative-draft-model-path",
                  tiny.draft]
    expected = ft_generate(*spec_flags, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--temperature", "0",
                           "--ignore-eos", "--max-tokens", "20")
    got = spec.client().completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=20, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert got.model_extra["token_ids"] == expected["token_ids"] and got.text == expected["text"]
    chat = ft_generate(*spec_flags, "--prompt", "Hello there", "--chat", "--temperature", "0", "--max-tokens", "20")
    reply = chat_once(spec.client(), messages=[{"role": "user", "content": "Hello there"}], max_tokens=20,
                      temperature=0, extra_body={"return_token_ids": True})["choices"][0]
    assert reply["token_ids"] == chat["token_ids"] and reply["content"] == chat["text"]
    assert reply["finish_reason"] == chat["finish_reason"]


def test_seeded_samples_equal_ft_generate_n(spec, tiny):
    expected = ft_generate("--model", tiny.target, "--speculative-algorithm", "dflash", "--speculative-depth", "fixed",
                           "--speculative-draft-model-path", tiny.draft, "--prompt-ids", "1,2,3", "--temperature",
                           "0.8", "--top-k", "50", "--seed", "5", "--n", "3", "--ignore-eos", "--max-tokens", "12")
    got = spec.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=12, temperature=0.8, n=3,
                                           seed=5, extra_body={"top_k": 50, "ignore_eos": True,
                                                               "return_token_ids": True})
    assert [c.model_extra["token_ids"] for c in got.choices] == [s["token_ids"] for s in expected["samples"]]


def test_sixteen_concurrent_streaming_clients_all_complete(spec):
    def one(i: int) -> tuple[str, str | None, int]:
        text, reason, tokens = "", None, 0
        stream = spec.client().completions.create(model=MODEL, prompt=[i + 1, 2 * i + 3, 7], max_tokens=16,
                                                  temperature=0.7, seed=i, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, reason, tokens

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [(r, t) for _, r, t in results] == [("length", 16)] * 16
    alone = spec.client().completions.create(model=MODEL, prompt=[4, 9, 7], max_tokens=16, temperature=0.7, seed=3,
                                             extra_body={"ignore_eos": True})
    assert results[3][0] == alone.choices[0].text  # batching changed nothing
    assert spec.settle().idle


def test_one_hundred_disconnects_leak_nothing(spec):
    idle = spec.settle()
    before = spec.metrics()
    body = {"model": MODEL, "prompt": [3, 1, 4, 1, 5], "max_tokens": 200, "ignore_eos": True, "temperature": 0.5}

    def disconnect(i: int) -> None:
        with spec.http(timeout=httpx.Timeout(30, read=0.05 if i % 4 == 3 else 30)) as http:
            if i % 4 == 3:  # non-streaming: the client times out while the engine works, and hangs up
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/completions", json=body)
                return
            with http.stream("POST", "/v1/chat/completions" if i % 2 else "/v1/completions",
                             json={**body, "stream": True, **({"messages": [{"role": "user", "content": "x"}],
                                                                "prompt": None} if i % 2 else {})}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for _ in range(i % 3):  # 0: before any token (often still queued), else after a few events
                    next(lines)

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(disconnect, range(100)))
    assert spec.settle().without_cache() == idle.without_cache()  # finished requests may have left snapshots
    after = spec.metrics()
    aborted = after['dflash2_request_finished_total{finish_reason="abort"}'] - \
        before['dflash2_request_finished_total{finish_reason="abort"}']
    assert aborted == 100  # each one ended early: none ran to its 200 tokens
    assert after["dflash2_generation_tokens_total"] - before["dflash2_generation_tokens_total"] < 100 * 200 / 4


def test_the_metrics_move(spec):
    before = spec.metrics()
    spec.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    after = spec.metrics()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("dflash2_generation_tokens_total") == 12
    assert moved("dflash2_prompt_tokens_total") > 0
    assert moved("dflash2_time_to_first_token_seconds_count") == 1
    assert moved("dflash2_time_per_output_token_seconds_count") == 1
    assert moved("dflash2_e2e_request_latency_seconds_count") == 1
    # TTFT's parts inside the engine: one observation each, and together within the TTFT the server saw
    assert moved("dflash2_request_queue_time_seconds_count") == 1
    assert moved("dflash2_request_prefill_time_seconds_count") == 1
    engine_ttft = moved("dflash2_request_queue_time_seconds_sum") + moved("dflash2_request_prefill_time_seconds_sum")
    assert 0 < engine_ttft <= moved("dflash2_time_to_first_token_seconds_sum")
    assert moved('dflash2_request_finished_total{finish_reason="length"}') == 1
    steps = moved("dflash2_spec_decode_num_verify_steps_total")
    assert steps >= 1 and moved("dflash2_spec_decode_tokens_per_verify_step_count") == steps
    assert moved("dflash2_spec_decode_num_draft_tokens_total") >= steps
    accepted = moved("dflash2_spec_decode_num_accepted_tokens_total")
    assert moved("dflash2_spec_decode_tokens_per_verify_step_sum") == steps + accepted
    assert moved('dflash2_spec_decode_num_accepted_tokens_per_pos_total{position="1"}') <= steps
    for gauge in ("dflash2_num_requests_running", "dflash2_num_requests_waiting", "dflash2_kv_pages_free"):
        assert gauge in after
    assert after["dflash2_kv_pages_free"] + after["dflash2_prefix_cache_pages"] == after["dflash2_kv_pages_total"]


def test_health_answers_during_a_long_step(spec, monkeypatch):
    engine = spec.engine
    original = engine.step
    in_step = threading.Event()

    def slow_step():
        in_step.set()
        time.sleep(1.5)
        return original()

    monkeypatch.setattr(engine, "step", slow_step)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(spec.client().completions.create, model=MODEL, prompt=[1, 2], max_tokens=1)
        assert in_step.wait(10)
        start = time.perf_counter()
        assert spec.http().get("/health").status_code == 200
        assert time.perf_counter() - start < 0.5
        monkeypatch.setattr(engine, "step", original)
        assert pending.result(timeout=30).choices[0].finish_reason in ("stop", "length")


def test_an_error_in_one_request_fails_it_alone(spec, monkeypatch):
    class Failing(Stopper):
        def check(self, output, checked=0):
            if self.params.seed == 666:
                raise RuntimeError("planted")
            return super().check(output, checked)

    monkeypatch.setattr(engine_module, "Stopper", Failing)
    client = spec.client()
    with ThreadPoolExecutor(2) as pool:
        ok = pool.submit(client.completions.create, model=MODEL, prompt=[1, 2, 3], max_tokens=30, seed=1,
                         extra_body={"ignore_eos": True})
        time.sleep(0.05)
        with pytest.raises(openai.InternalServerError, match="planted"):
            client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=30, seed=666)
        with pytest.raises(openai.APIError, match="planted"):
            for _ in client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=30, seed=666, stream=True):
                pass
        assert ok.result(timeout=60).choices[0].finish_reason == "length"
    assert spec.settle().idle


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(spec, monkeypatch):
    runner = spec.engine.runner
    original = runner.verify

    def broken(*args, **kwargs):
        monkeypatch.setattr(runner, "verify", original)  # fail once
        raise RuntimeError("planted step failure")

    monkeypatch.setattr(runner, "verify", broken)
    with pytest.raises(openai.InternalServerError, match="planted step failure"):  # ignore_eos: a sampled first
        # token that is EOS could end the request at its prefill, before any verify step (a full CPU run once
        # saw no error raised)
        spec.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8, extra_body={"ignore_eos": True})
    assert spec.settle().idle
    again = spec.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert again.choices[0].finish_reason == "length" and spec.http().get("/health").status_code == 200


def test_a_second_turn_reports_its_cached_tokens(spec):
    """The prefix cache under the server: a request that extends a finished one resumes after its history, and
    says so in ``usage.prompt_tokens_details.cached_tokens`` (streamed and not) and in the prefix-cache counters."""
    http = spec.http()
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    first = http.post("/v1/completions", json={**body, "prompt": PROMPT_IDS * 3}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    history = PROMPT_IDS * 3 + first["choices"][0]["token_ids"]
    before = spec.metrics()
    second = http.post("/v1/completions", json={**body, "prompt": history + [7, 8]}).json()
    frontier = len(history) - 1  # the first request's last token never went through the target
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": frontier}
    after = spec.metrics()
    assert after["dflash2_prefix_cache_hits_total"] - before.get("dflash2_prefix_cache_hits_total", 0) == frontier
    assert after["dflash2_prefix_cache_queries_total"] - before.get("dflash2_prefix_cache_queries_total", 0) == \
        len(history) + 2
    third = history + [7, 8] + second["choices"][0]["token_ids"] + [9]
    stream = spec.client().completions.create(model=MODEL, prompt=third, max_tokens=3, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == len(third) - 2  # after the second turn's last token
