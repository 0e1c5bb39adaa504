"""The OpenAI wire format ``ft serve`` speaks: request and response schemas, their validation, errors.

Requests are validated strictly, as JSON: a field of the wrong type (``"5"`` for an integer, ``true``
for a number, ``NaN``) or out of its range is refused with a 400 whose OpenAI-style body names the
field, the value and what was expected::

    {"error": {"message": "temperature=3.0: Input should be less than or equal to 2",
               "type": "invalid_request_error", "param": "temperature", "code": null}}

Unknown fields are ignored, as OpenAI-compatible servers do (clients send provider-specific ones);
known OpenAI fields whose feature this server lacks (tools, penalties, logit bias, structured
output, echo, best_of, suffix) are accepted only at their neutral values. Extensions, as in vLLM:
``top_k`` (-1 is off), ``ignore_eos``, ``return_token_ids`` (the choice carries ``token_ids``, the
response ``prompt_token_ids``) and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``).

Sampling follows ``SamplingParams`` (``reference/request/sampling_params.py``): the same defaults as
``ft generate`` (temperature 1, top_p 1, top_k off), ``temperature`` 0 is greedy; a request without a
``seed`` draws one at random, and choice j of ``n > 1`` uses ``derive_seed(seed, j)`` as ``ft generate
--n`` does. ``max_tokens`` defaults to 16 for completions and to the rest of ``max_model_len`` for chat.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 128  # choices per request (OpenAI's bound)
MAX_STOP = 4  # stop strings per request (OpenAI's bound)
MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's bound); the completions API allows 5
MAX_COMPLETION_LOGPROBS = 5
MAX_SEED = 2**64 - 1
# pydantic's tags for union members and validators in an error's location, not field names
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


class APIError(Exception):
    """An error answered with ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _clip(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _path(loc) -> list[str]:
    """The field path of an error location: ``body``, union-member and validator tags dropped."""
    return [str(p) for p in loc if p != "body" and str(p).split("[")[0] not in _TYPE_TAGS and "[" not in str(p)]


def validation_error(errors: list[dict]) -> APIError:
    """A pydantic/FastAPI validation failure as one 400 naming field, value and expectation.

    A union field fails once per member; those messages are joined ("... or ...")."""
    first = errors[0]
    cause = first.get("ctx", {}).get("error")
    path = _path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", "invalid JSON"))
        return APIError(400, f"request body: expected valid JSON ({detail})", code="invalid_json")
    if isinstance(cause, _Unsupported):  # a model validator's refusal names its own field
        param = ".".join(path + [cause.field])
        return APIError(400, f"{param}={_clip(cause.value)}: expected {cause.expected}", param=param)
    param = ".".join(path) or None
    if first.get("type") == "missing":
        return APIError(400, f"{param}: a required field is missing", param=param)
    if not path:
        return APIError(400, f"request body {_clip(first.get('input'))}: expected a JSON object")
    messages = []
    for err in errors:
        if _path(err.get("loc", ())) == path:
            msg = err.get("msg", "invalid").removeprefix("Value error, ")
            if messages:  # "Input should be a valid string or a valid list"
                msg = msg.removeprefix("Input should be ")
            if msg not in messages:
                messages.append(msg)
    return APIError(400, f"{param}={_clip(first.get('input'))}: {' or '.join(messages)}", param=param)


def pydantic_error(exc: ValidationError) -> APIError:
    return validation_error(exc.errors(include_url=False))


class _Request(BaseModel):
    """Strict JSON types, finite numbers; unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """The fields both endpoints share."""

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension: -1 is off, 0 is not allowed")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None
    # OpenAI fields accepted only at their neutral values
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value):
        if value == 0:
            raise ValueError("expected -1 (off) or an integer >= 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None:
            if len(stops) > MAX_STOP:
                raise ValueError(f"expected at most {MAX_STOP} stop strings")
            if any(s == "" for s in stops):
                raise ValueError("expected non-empty stop strings")
        return value

    @model_validator(mode="after")
    def _neutral(self):
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise _unsupported(name, getattr(self, name), "0 (penalties are not supported)")
        if self.logit_bias:
            raise _unsupported("logit_bias", self.logit_bias, "an empty map (logit bias is not supported)")
        if self.stream_options is not None and not self.stream:
            raise _unsupported("stream_options", self.stream_options.model_dump(), "no stream_options without "
                               "stream=true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class _Unsupported(ValueError):
    """Raised inside a model validator: surfaces as a 400 naming the field, its value, the expectation."""

    def __init__(self, field: str, value, expected: str):
        super().__init__(f"{field}={_clip(value)}: expected {expected}")
        self.field, self.value, self.expected = field, value, expected


def _unsupported(field: str, value, expected: str) -> ValueError:
    return _Unsupported(field, value, expected)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            for i, part in enumerate(data["content"]):
                if isinstance(part, dict) and part.get("type") != "text":
                    raise _Unsupported(f"content.{i}.type", part.get("type"), "'text' (only text content is "
                                       "supported)")
        if isinstance(data, dict) and data.get("tool_calls"):
            raise _Unsupported("tool_calls", data["tool_calls"], "none (tool calls are not supported)")
        return data

    def template_dict(self) -> dict:
        """The message as the chat template reads it (``developer`` is OpenAI's name for ``system``)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if isinstance(self.content, list):
            out["content"] = [{"type": "text", "text": p.text} for p in self.content]
        else:
            out["content"] = self.content
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, bool | int | float | str] | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_neutral(self):
        if self.tools:
            raise _unsupported("tools", self.tools, "none (tool calling is not supported)")
        if self.response_format not in (None, {"type": "text"}):
            raise _unsupported("response_format", self.response_format, "{'type': 'text'} (structured output is "
                               "not supported)")
        if self.top_logprobs is not None and not self.logprobs:
            raise _unsupported("top_logprobs", self.top_logprobs, "logprobs=true with it")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise _unsupported("max_completion_tokens", self.max_completion_tokens,
                               f"the same value as max_tokens ({self.max_tokens}) when both are given")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; else the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and len(value) == 0:
            raise ValueError("expected a non-empty prompt (a string, token ids, or a list of either)")
        return value

    @model_validator(mode="after")
    def _completion_neutral(self):
        if self.echo:
            raise _unsupported("echo", self.echo, "false (echo is not supported)")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", self.best_of, f"n ({self.n}) or none (best_of is not supported)")
        if self.suffix:
            raise _unsupported("suffix", self.suffix, "none (suffix is not supported)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one string or id list, or a batch of them."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs


def parse(model: type[_Request], body: Any) -> _Request:
    """Validate a decoded JSON body; APIError 400 on any failure."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise pydantic_error(exc) from None


# ---- responses (for the published OpenAPI schema; handlers build plain dicts of the same shape) ----


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash2"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
