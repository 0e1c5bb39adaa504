"""The OpenAI-compatible HTTP API on FastAPI: thin handlers over one engine API (``EngineLoop``).

    POST /v1/chat/completions   the checkpoint's chat template; SSE streaming or one JSON response
    POST /v1/completions        a prompt string, token ids, or a batch of either
    GET  /v1/models             the served model
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text (``metrics.py``)
    GET  /server_info           the served model's name and the engine's limits, and
    GET  /model_info            the model's type: what a router (``sglang-router``) reads when a worker
                                registers, so it lists and routes the model by its served name

A handler validates the body (``protocol.py``; any failure a 4xx with the OpenAI error body, never
a 500), builds the prompt ids (chat template and encoding run on a worker thread), makes one engine
request per (prompt, choice) with ``Engine.new_request`` (the engine's own checks: ids, lengths,
cache capacity), submits them (429 when the queue is full) and then either streams their deltas as
SSE or collects them. A client that disconnects, streaming or not, aborts its requests at once.
With an API key, every ``/v1`` request must carry ``Authorization: Bearer KEY`` (401 otherwise),
checked before the body is read; bodies over ``max_request_bytes`` get a 413; a ``/v1`` body is read
as JSON whatever its Content-Type says (``curl -d`` says form data).

The tokenizer is the engine's object, shared: only its read-only calls are made here (encode without
truncation or padding, decode, token lookups, the chat template as text), which ``tokenizers``
runs concurrently with the engine thread's decoding.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash2.reference.formats.errors import UserInputError
from dflash2.reference.request.rng import derive_seed
from dflash2.reference.request.sampling_params import SamplingParams

from ..engine.engine import Engine, RequestDelta
from ..engine.logprobs import TokenLogprob
from . import protocol as p
from .detokenize import IncrementalText, TokenStrings
from .engine_loop import EngineLoop, EngineStopped, QueueFull, RequestGroup
from .metrics import ServeMetrics
from .settings import ServeSettings
from .sse import DONE, EventStream, event

logger = logging.getLogger("dflash2.fast.serve")
MIN_LOGPROB = -9999.0  # JSON has no -inf: a token outside the filtered support reads as this (as vLLM)
# apply_chat_template arguments that change what it returns: not template variables
RESERVED_TEMPLATE_KWARGS = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                            "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def _error_response(error: p.APIError, metrics: ServeMetrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.rejected(error.status)
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _param_of(message: str) -> str | None:
    """The field a ``name=value: ...`` engine message names (the project's error convention)."""
    match = re.match(r"([a-z_]+)[=: (]", message)
    return match.group(1) if match else None


class _Guard:
    """ASGI middleware: the API key and the body size, checked before anything reads the body."""

    def __init__(self, app, settings: ServeSettings, metrics: ServeMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.key = None if settings.api_key is None else f"Bearer {settings.api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.key is not None and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                return await _error_response(p.APIError(401, "missing or wrong API key: expected the header "
                                                        "'Authorization: Bearer <key>'", code="invalid_api_key"),
                                             self.metrics)(scope, receive, send)
        if scope["method"] == "POST" and scope["path"].startswith("/v1") and \
                not headers.get(b"content-type", b"").startswith(b"application/json"):
            # every /v1 body is JSON: read it so whatever the client said (curl -d says form data)
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        limit = self.settings.max_request_bytes
        length = headers.get(b"content-length")
        too_large = p.APIError(413, f"request body: expected at most {limit} bytes", code="request_too_large")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _error_response(too_large, self.metrics)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge
            return message

        await self.app(scope, counted, send)


class _BodyTooLarge(Exception):
    """A chunked body ran past the limit (FastAPI re-raises it as the cause of an HTTPException)."""


class Server:
    """The handlers' state: the engine loop, the tokenizer, the metrics, the settings."""

    def __init__(self, engine: Engine, settings: ServeSettings):
        self.engine, self.settings = engine, settings
        self.tokenizer = engine.tokenizer
        self.metrics = ServeMetrics(settings.served_model_name, engine.model.k)
        self.loop = EngineLoop(engine, max_queued=settings.max_queued_requests, metrics=self.metrics)
        self.token_strings = TokenStrings(self.tokenizer)
        self.created = int(time.time())
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="dflash2-tokenize")

    # ---- prompts --------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.settings.served_model_name:
            raise p.APIError(404, f"model={model!r}: expected {self.settings.served_model_name!r} (GET /v1/models)",
                             param="model", code="model_not_found")

    async def tokenize(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, *args)

    def chat_prompt(self, body: p.ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise p.APIError(400, "messages: this checkpoint has no tokenizer, so there is no chat template "
                             "(use /v1/completions with token ids)", param="messages")
        kwargs = dict(body.chat_template_kwargs or {})
        bad = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS or not k.isidentifier())
        if bad:
            raise p.APIError(400, f"chat_template_kwargs keys {bad}: expected template variables (not "
                             "apply_chat_template's own arguments)", param="chat_template_kwargs")
        messages = [m.template_dict() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and what the template raises
            raise p.APIError(400, f"messages: the chat template refused them ({exc})", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def completion_prompts(self, body: p.CompletionRequest) -> list[list[int]]:
        out = []
        for prompt in body.prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise p.APIError(400, "prompt: this checkpoint has no tokenizer, so a text prompt cannot be "
                                     "encoded (give token ids)", param="prompt")
                out.append(self.tokenizer.encode(prompt, add_special_tokens=False))
            else:
                out.append(list(prompt))
        return out

    # ---- requests -------------------------------------------------------------------------------

    def make_requests(self, body, prompts: list[list[int]], prompt_field: str) -> list:
        """One validated engine request per (prompt, choice), in choice-index order."""
        # a request reserves KV pages for its whole budget: the default max_tokens must fit the cache
        memory = self.engine.model.memory
        max_len = min(self.engine.max_model_len, memory.kv_tokens)
        context = self.engine.model.target_cfg.max_position_embeddings
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        defaults = {f: getattr(SamplingParams, f) for f in ("temperature", "top_p", "top_k")}
        reqs = []
        for ids in prompts:
            if len(ids) >= max_len:
                raise p.APIError(400, f"{prompt_field} ({len(ids)} tokens): expected fewer than the "
                                 f"{max_len} tokens a request may hold (max_model_len, KV cache)", param=prompt_field,
                                 code="context_length_exceeded")
            max_tokens = body.max_new_tokens if isinstance(body, p.ChatCompletionRequest) else body.max_tokens
            if max_tokens is None:
                max_tokens = max_len - len(ids)
            elif len(ids) + max_tokens > context:
                raise p.APIError(400, f"max_tokens={max_tokens}: the prompt ({len(ids)} tokens) + max_tokens "
                                 f"= {len(ids) + max_tokens}, expected at most the model's context of {context} "
                                 "tokens", param="max_tokens", code="context_length_exceeded")
            for j in range(body.n):
                try:
                    params = SamplingParams(
                        max_tokens=max_tokens, seed=seed if body.n == 1 else derive_seed(seed, j),
                        stop=body.stop_list, ignore_eos=body.ignore_eos,
                        **{f: getattr(body, f) if getattr(body, f) is not None else d for f, d in defaults.items()})
                    reqs.append((self.engine.new_request(ids, params), body.num_top_logprobs))
                except UserInputError as exc:
                    message = str(exc)
                    param = _param_of(message)
                    raise p.APIError(400, message, param=prompt_field if param == "prompt" else param) from None
        return reqs

    def submit(self, reqs) -> RequestGroup:
        try:
            return self.loop.submit(reqs)
        except QueueFull as exc:
            raise p.APIError(429, f"the server is at capacity: {exc}", type="rate_limit_error",
                             code="queue_full") from None
        except EngineStopped as exc:
            raise p.APIError(503, f"the server is not taking requests: {exc}", type="server_error",
                             code="unavailable") from None

    async def collect(self, request: Request, group: RequestGroup) -> dict[int, list[RequestDelta]]:
        """Every delta of the group by member index; aborts the group if the client goes away."""
        async def gather():
            out: dict[int, list[RequestDelta]] = {}
            async for index, delta in group.deltas():
                out.setdefault(index, []).append(delta)
            return out

        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        collector, watcher = asyncio.ensure_future(gather()), asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if collector in done:
                return collector.result()
            raise ClientGone
        finally:
            collector.cancel()
            watcher.cancel()
            group.abort()

    # ---- formatting -----------------------------------------------------------------------------

    @staticmethod
    def _lp(value: float) -> float:
        return value if math.isfinite(value) else MIN_LOGPROB

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict:
        content = []
        for lp in logprobs:
            token, raw = self.token_strings(lp.token_id)
            top = []
            for tid, value in lp.top:
                t, b = self.token_strings(tid)
                top.append({"token": t, "logprob": self._lp(value), "bytes": b})
            content.append({"token": token, "logprob": self._lp(lp.logprob), "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(self, logprobs: Sequence[TokenLogprob], offset: int, with_top: bool) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            token = self.token_strings(lp.token_id)[0]
            tokens.append(token)
            values.append(self._lp(lp.logprob))
            offsets.append(offset)
            offset += len(token)
            tops.append({self.token_strings(t)[0]: self._lp(v) for t, v in lp.top})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if with_top else None,
                "text_offset": offsets}

    def internal_error(self, delta: RequestDelta) -> p.APIError:
        if delta.finish_reason == "abort":
            return p.APIError(503, "the server stopped before the request finished", type="server_error",
                              code="aborted")
        return p.APIError(500, delta.error or "internal error", type="server_error", code="internal_error")


def create_app(engine: Engine, settings: ServeSettings) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it after uvicorn has drained."""
    server = Server(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.loop.stop)
            server._tokenize.shutdown(wait=False)

    app = FastAPI(title="dflash2 ft serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API on the dflash2 fast engine")
    app.state.server = server
    app.add_middleware(_Guard, settings=settings, metrics=server.metrics)
    errors = {400: {"model": p.ErrorResponse}, 401: {"model": p.ErrorResponse}, 404: {"model": p.ErrorResponse},
              429: {"model": p.ErrorResponse}}

    @app.exception_handler(p.APIError)
    async def api_error(request: Request, exc: p.APIError):
        return _error_response(exc, server.metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _error_response(p.validation_error(list(exc.errors())), server.metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, _BodyTooLarge):
            return _error_response(p.APIError(413, f"request body: expected at most {settings.max_request_bytes} "
                                              "bytes", code="request_too_large"), server.metrics)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(p.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                          type=kind), server.metrics)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error_response(p.APIError(500, f"internal error: {type(exc).__name__}", type="server_error",
                                          code="internal_error"), server.metrics)

    @app.get("/health")
    async def health():
        if server.loop.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info():
        # sglang-router's worker discovery reads served_model_name (its model id for the worker); the rest is
        # what an operator wants beside it. No local paths: this route is open like /health and /metrics.
        cfg = engine.config
        return {"served_model_name": settings.served_model_name, "version": app.version, "engine": "dflash2",
                "max_running_requests": cfg.max_running_req, "max_total_tokens": engine.model.memory.kv_tokens,
                "max_model_len": engine.max_model_len, "speculative_algorithm": cfg.speculative_algorithm,
                "speculative_num_steps": engine.model.k, "prefix_caching": engine.prefix_cache is not None}

    @app.get("/model_info")
    async def model_info():
        return {"model_id": settings.served_model_name, "model_type": engine.model.target_cfg.model_type,
                "is_generation": True, "has_tokenizer": engine.tokenizer is not None}

    @app.get("/v1/models", response_model=p.ModelList)
    async def models():
        card = p.ModelCard(id=settings.served_model_name, created=server.created, max_model_len=engine.max_model_len)
        return p.ModelList(data=[card])

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": p.ChatCompletionResponse}, **errors})
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        ids = await server.tokenize(server.chat_prompt, body)
        group = server.submit(server.make_requests(body, [ids], "messages"))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return EventStream(_chat_stream(server, body, group, ids, rid, created), on_close=group.abort)
        try:
            results = await server.collect(request, group)
        except ClientGone:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for index in range(body.n):
            deltas = results[index]
            last, tokens = _finished(server, deltas)
            completion_tokens += len(tokens)
            choice = {"index": index, "message": {"role": "assistant", "content": last.text},
                      "logprobs": None, "finish_reason": last.finish_reason}
            if body.logprobs:
                choice["logprobs"] = server.chat_logprobs([lp for d in deltas for lp in d.logprobs or ()])
            if body.return_token_ids:
                choice["token_ids"] = tokens
            choices.append(choice)
        out = {"id": rid, "object": "chat.completion", "created": created, "model": settings.served_model_name,
               "choices": choices, "usage": _usage(len(ids), completion_tokens, results[0][-1].cached_tokens)}
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
        return JSONResponse(out)

    @app.post("/v1/completions", response_model=None, responses={200: {"model": p.CompletionResponse}, **errors})
    async def completions(body: p.CompletionRequest, request: Request):
        server.check_model(body.model)
        prompts = await server.tokenize(server.completion_prompts, body)
        group = server.submit(server.make_requests(body, prompts, "prompt"))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return EventStream(_completion_stream(server, body, group, prompts, rid, created), on_close=group.abort)
        try:
            results = await server.collect(request, group)
        except ClientGone:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for index in range(len(prompts) * body.n):
            deltas = results[index]
            last, tokens = _finished(server, deltas)
            completion_tokens += len(tokens)
            choice = {"index": index, "text": last.text, "logprobs": None, "finish_reason": last.finish_reason}
            if body.logprobs is not None:
                choice["logprobs"] = server.completion_logprobs([lp for d in deltas for lp in d.logprobs or ()], 0,
                                                                True)
            if body.return_token_ids:
                choice["token_ids"] = tokens
                choice["prompt_token_ids"] = prompts[index // body.n]
            choices.append(choice)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": settings.served_model_name, "choices": choices,
                             "usage": _usage(sum(len(x) for x in prompts), completion_tokens,
                                             sum(results[i][-1].cached_tokens for i in range(0, len(results), body.n)))})

    return app


def _finished(server: Server, deltas: list) -> tuple:
    """A collected request's last delta and all its tokens; a request that did not end in "stop" or
    "length" (an error inside the engine) is the server's error response instead."""
    last = deltas[-1]
    if last.finish_reason not in ("stop", "length"):
        raise server.internal_error(last)
    return last, [t for d in deltas for t in d.token_ids]


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens restored from the prefix cache (once per prompt)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def _stream(server: Server, body, group: RequestGroup, num_prompt_tokens: int, rid: str, created: int,
                  obj: str, choice_of, opening=()):
    """The SSE events of one request: ``opening`` events, one event per delta worth sending (with the
    ``choice_of(index, delta, text)`` dict), the usage event when asked for, then [DONE]. A member
    that fails ends the stream with an error event; leaving early (a disconnect) aborts the rest."""
    model = server.settings.served_model_name
    decode = server.engine.decode if server.tokenizer else None
    texts: dict[int, IncrementalText] = {}
    completion_tokens = 0
    cached: dict[int, int] = {}  # member index -> its prompt tokens restored from the prefix cache

    def payload(choices: list, usage=None) -> str:
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
        if body.include_usage:
            out["usage"] = usage
        return event(out)

    try:
        for choice in opening:
            yield payload([choice])
        async for index, delta in group.deltas():
            completion_tokens += len(delta.token_ids)
            cached[index] = delta.cached_tokens
            if delta.finished and delta.finish_reason not in ("stop", "length"):
                yield event(server.internal_error(delta).body())
                break
            text_of = texts.setdefault(index, IncrementalText(decode, body.stop_list))
            # the last delta may hold a whole stop string: its text is the rest of the engine's final text
            text = text_of.finish(delta.text or "") if delta.finished else text_of.add(delta.token_ids)
            if text or delta.logprobs or delta.finished or (body.return_token_ids and delta.token_ids):
                yield payload([choice_of(index, delta, text)])
        else:
            if body.include_usage:
                # members i * n .. i * n + n - 1 share prompt i: count its cached tokens once
                yield payload([], _usage(num_prompt_tokens, completion_tokens,
                                         sum(n for i, n in cached.items() if i % body.n == 0)))
        yield DONE
    finally:
        group.abort()


def _chat_stream(server: Server, body: p.ChatCompletionRequest, group: RequestGroup, ids: list[int], rid: str,
                 created: int):
    def choice_of(index: int, delta: RequestDelta, text: str) -> dict:
        choice = {"index": index, "delta": {"content": text} if text or not delta.finished else {},
                  "logprobs": server.chat_logprobs(delta.logprobs) if body.logprobs and delta.logprobs else None,
                  "finish_reason": delta.finish_reason if delta.finished else None}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice

    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(body.n)]
    return _stream(server, body, group, len(ids), rid, created, "chat.completion.chunk", choice_of, opening)


def _completion_stream(server: Server, body: p.CompletionRequest, group: RequestGroup, prompts: list[list[int]],
                       rid: str, created: int):
    offsets: dict[int, int] = {}  # text_offset of each choice's next token

    def choice_of(index: int, delta: RequestDelta, text: str) -> dict:
        logprobs = None
        if body.logprobs is not None and delta.logprobs:
            logprobs = server.completion_logprobs(delta.logprobs, offsets.get(index, 0), True)
            offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": delta.finish_reason if delta.finished else None}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice

    return _stream(server, body, group, sum(len(x) for x in prompts), rid, created, "text_completion", choice_of)
