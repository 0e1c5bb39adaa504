"""No request, however malformed, gets a 500 or hurts the others: bad bodies get a 4xx with the OpenAI
error body naming the field; the API key gives 401s; a full queue gives 429s; bodies fuzzed from the
OpenAPI schema the server publishes all get a 4xx or a 200 (streams end with [DONE]); the pools are
idle afterwards."""

from __future__ import annotations

import copy
import json
import random
import threading

import openai
import pytest
from serve_harness import MODEL, settings, start

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}


def assert_error(response, status: int, param: str | None = "?", code: str | None = "?") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in response.text and body["error"]["message"]
    if param != "?":
        assert body["error"]["param"] == param, body
    if code != "?":
        assert body["error"]["code"] == code, body
    return body["error"]


BAD_BODIES = [
    ("chat", {**CHAT, "temperature": "hot"}, "temperature", "valid number"),
    ("chat", {**CHAT, "temperature": 2.5}, "temperature", "less than or equal to 2"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("chat", {**CHAT, "max_tokens": 1.5}, "max_tokens", "valid integer"),
    ("chat", {**CHAT, "n": True}, "n", "valid integer"),
    ("chat", {**CHAT, "n": 129}, "n", "128"),
    ("chat", {**CHAT, "top_p": 0}, "top_p", "greater than 0"),
    ("chat", {**CHAT, "top_k": 0}, "top_k", "-1 (off)"),
    ("chat", {**CHAT, "seed": -3}, "seed", "greater than or equal to 0"),
    ("chat", {**CHAT, "seed": 2**64}, "seed", "less than or equal to"),
    ("chat", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("chat", {**CHAT, "stop": [""]}, "stop", "non-empty"),
    ("chat", {**CHAT, "messages": []}, "messages", "at least 1"),
    ("chat", {**CHAT, "messages": "hi"}, "messages", "valid list"),
    ("chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type", "only text"),
    ("chat", {**CHAT, "messages": [{"role": "assistant", "content": "x"}]}, "messages", "No user query"),
    ("chat", {**CHAT, "top_logprobs": 3}, "top_logprobs", "logprobs=true"),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("chat", {**CHAT, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ("chat", {**CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ("chat", {**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "template variables"),
    ("chat", {**CHAT, "stream": "yes"}, "stream", "valid boolean"),
    ("chat", {k: v for k, v in CHAT.items() if k != "model"}, "model", "required"),
    ("chat", {**CHAT, "max_tokens": 40000}, "max_tokens", "context"),
    ("completion", {**COMPLETION, "prompt": []}, "prompt", "non-empty"),
    ("completion", {**COMPLETION, "prompt": [1, 10**6]}, "prompt", "[0, 512)"),
    ("completion", {**COMPLETION, "prompt": [-1]}, "prompt", "[0, 512)"),
    ("completion", {**COMPLETION, "prompt": list(range(1, 41))}, "prompt", "fewer than"),
    ("completion", {**COMPLETION, "prompt": {"text": "x"}}, "prompt", "valid string"),
    ("completion", {**COMPLETION, "logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("completion", {**COMPLETION, "echo": True}, "echo", "not supported"),
    ("completion", {**COMPLETION, "best_of": 3}, "best_of", "not supported"),
]


@pytest.mark.parametrize("endpoint,body,param,words", BAD_BODIES, ids=[f"{b[0]}-{b[2]}-{i}"
                                                                         for i, b in enumerate(BAD_BODIES)])
def test_bad_bodies_get_a_400_naming_the_field(plain, endpoint, body, param, words):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    error = assert_error(plain.http().post(path, json=body), 400, param)
    assert words.lower() in error["message"].lower(), error
    assert error["type"] == "invalid_request_error"


def test_malformed_requests_get_a_4xx(plain):
    http = plain.http()
    assert_error(http.post("/v1/completions", content=b'{"model": "tiny", "prompt": [1,'), 400, None, "invalid_json")
    assert_error(http.post("/v1/completions", content=b"\xff\xfe garbage", headers={"content-type":
                                                                                   "application/json"}), 400)
    assert_error(http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/completions", content=b"prompt=1", headers={"content-type": "text/plain"}), 400,
                 None, "invalid_json")
    # as curl -d sends it; ignore_eos: the request samples with a random seed, and a drawn EOS would end it
    # before max_tokens (a fresh-clone CI run once drew one: finish_reason "stop")
    form = http.post("/v1/completions", content=json.dumps({**COMPLETION, "ignore_eos": True}).encode(),
                     headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 200 and form.json()["choices"][0]["finish_reason"] == "length"
    assert_error(http.post("/v1/completions"), 400)
    assert_error(http.post("/v1/completions", content=b'{"temperature": NaN, "model": "tiny", "prompt": "x"}',
                           headers={"content-type": "application/json"}), 400, "temperature")
    assert_error(http.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"}), 404, "model", "model_not_found")
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)
    limit = plain.server.settings.max_request_bytes
    assert_error(http.post("/v1/completions", content=b"x" * (limit + 1), headers={"content-type":
                                                                                   "application/json"}), 413)

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(limit // 65536 + 1):
            yield b"a" * 65536
        yield b'"}'

    assert_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert plain.settle().idle


def test_the_api_key_guards_every_v1_route(tiny):
    live = start(tiny, settings(api_key="sekret"))
    try:
        http = live.http()
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            error = assert_error(http.post("/v1/completions", json=COMPLETION, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert_error(http.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert_error(http.post("/v1/completions", content=b"{not json", headers={"Authorization": "x"}), 401)
        assert http.get("/health", headers={"Authorization": ""}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        assert [m.id for m in live.client().models.list().data] == [MODEL]
    finally:
        live.stop()


def test_a_full_queue_answers_429_and_recovers(tiny):
    live = start(tiny, settings(max_queued_requests=1), max_running_req=1)
    try:
        client = live.client()
        started = threading.Barrier(3)
        streams = []

        def hold():
            stream = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=40, stream=True,
                                               extra_body={"ignore_eos": True})
            started.wait(30)
            streams.append([c.choices[0].finish_reason for c in stream if c.choices][-1])

        threads = [threading.Thread(target=hold) for _ in range(2)]
        for t in threads:
            t.start()
        started.wait(30)  # one running, one queued: the server is full
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):  # n counts against the queue too
            client.completions.create(model=MODEL, prompt=[1], max_tokens=2, n=3)
        for t in threads:
            t.join(60)
        assert streams == ["length", "length"]  # the two admitted requests were not hurt by the refusals
        assert client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2).choices[0].text is not None
        assert live.metrics()['dflash2_request_rejected_total{status="429"}'] == 2
        assert live.settle().idle
    finally:
        live.stop()


def test_a_dead_engine_thread_fails_its_requests_and_health_says_503(tiny):
    live = start(tiny)
    try:
        def broken(engine, deltas):
            raise RuntimeError("planted engine-thread failure")

        live.server.metrics.on_step = broken
        with pytest.raises(openai.InternalServerError, match="the engine stopped"):
            live.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
        assert live.http().get("/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            live.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "unavailable"
    finally:
        live.stop()


# ---- fuzzing from the published schema ----------------------------------------------------------


class Fuzzer:
    """Request bodies from the OpenAPI schema: a valid body with one to three fields replaced by values
    of the right type (in range or not), of the wrong type, or removed, and keys the schema lacks."""

    ODD = [None, True, False, 0, -1, 1, 2, 3, 2**31, 2**64, -(2**63), 0.5, -0.0, 1e308, "", "x", "tiny", [], [1],
           ["a"], {}, {"type": "text"}, [[1, 2]], [{"role": "user"}], "\u0000\ud7ff"]

    def __init__(self, openapi: dict, seed: int):
        self.schemas = openapi["components"]["schemas"]
        self.rng = random.Random(seed)

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.schemas[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def value(self, schema: dict, depth: int = 0):
        """A value the schema allows, or nearly: numbers anywhere near and past their bounds."""
        schema = self.resolve(schema)
        options = schema.get("anyOf") or schema.get("oneOf")
        if options:
            return self.value(self.rng.choice(options), depth)
        if "enum" in schema:
            return self.rng.choice(schema["enum"] + ["other"])
        if "const" in schema:
            return schema["const"]
        kind = schema.get("type")
        rng = self.rng
        if kind == "integer":
            low, high = schema.get("minimum", -5), schema.get("maximum", 10**6)
            return rng.choice([low, low - 1, high, high + 1, rng.randint(int(max(low, -5)), int(min(high, 6)))])
        if kind == "number":
            return rng.choice([schema.get("minimum", -1.0), schema.get("maximum", 3.0), rng.uniform(-1, 3)])
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "string":
            return rng.choice(["", "hi", "stop", "\n", "\u00e9\u4e2d", "tiny", "a" * 300])
        if kind == "array":
            if depth > 3:
                return []
            return [self.value(schema.get("items", {}), depth + 1) for _ in range(rng.randint(0, 3))]
        if kind == "object" or "properties" in schema:
            if depth > 3:
                return {}
            return {k: self.value(v, depth + 1) for k, v in schema.get("properties", {}).items()
                    if k in schema.get("required", ()) or rng.random() < 0.3}
        return rng.choice(self.ODD)

    def body(self, base: dict, schema_name: str):
        schema = self.resolve({"$ref": f"#/components/schemas/{schema_name}"})
        body = copy.deepcopy(base)
        for _ in range(self.rng.randint(1, 3)):
            name = self.rng.choice(sorted(schema["properties"]) + ["unknown_field"])
            roll = self.rng.random()
            if roll < 0.5 and name in schema["properties"]:
                body[name] = self.value(schema["properties"][name])
            elif roll < 0.8:
                body[name] = self.rng.choice(self.ODD)
            else:
                body.pop(name, None)
        if self.rng.random() < 0.05:
            return self.rng.choice(self.ODD)  # not an object at all
        return body


def test_fuzzed_bodies_from_the_published_schema_get_4xx_or_200(plain):
    http = plain.http(timeout=60)
    openapi = http.get("/openapi.json").json()
    paths = openapi["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(paths)
    fuzzer = Fuzzer(openapi, seed=1234)
    statuses = {}
    for i in range(240):
        path, base, schema = (("/v1/chat/completions", CHAT, "ChatCompletionRequest") if i % 2 else
                              ("/v1/completions", COMPLETION, "CompletionRequest"))
        body = fuzzer.body(base, schema)
        raw = json.dumps(body).encode()
        if i % 40 == 39:  # and now and then a damaged byte
            cut = fuzzer.rng.randrange(len(raw))
            raw = raw[:cut] + bytes([fuzzer.rng.randrange(256)]) + raw[cut + 1:]
        with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
            text = r.read().decode("utf-8", errors="replace")
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, text)
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, (body, text)
        elif r.status_code == 200:
            assert json.loads(text)["choices"], (body, text)
        else:
            assert_error(_Response(r.status_code, text), r.status_code)
    assert statuses.get(200, 0) >= 20 and sum(v for k, v in statuses.items() if k >= 400) >= 100, statuses
    assert plain.settle().idle
    assert plain.http().get("/health").status_code == 200


class _Response:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)
