"""The engine loop: requests in, one scheduled step at a time, ``RequestOutput`` s out.

``Engine.generate`` validates each request alone (a bad one gets its error in its output and never
touches the batch), queues the rest, and steps until every request is finished:

    plan = scheduler.schedule()          a prefill plan (prompt chunks) or a decode plan (all running)
    tokens = runner.prefill / decode / verify(plan)
    commit: append the tokens, check stop ids, stop strings, max_tokens; finish and free resources
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from dflash2.reference.formats.errors import RequestError, UserInputError
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.request.stopping import Stopper
from dflash2.reference.request.trace import StepRecord

from .config import EngineConfig
from .runner import ModelRunner
from .scheduler import PrefillPlan, Req, Scheduler
from .startup import LoadedModel, load_model


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None  # why the request was refused (finish_reason "error", no tokens)
    verify_steps: int = 0  # speculative steps (0 for plain decoding)
    num_emitted: int = 0  # tokens committed by those steps, before any cut at a stop
    timing: dict[str, float] = field(default_factory=dict)  # prefill_s, decode_s, total_s, output_tokens_per_s
    steps: list[StepRecord] = field(default_factory=list)  # with trace=True

    @property
    def tokens_per_step(self) -> float:
        """Committed tokens per verify step (the reference's ``SpeculativeResult.tokens_per_step``)."""
        return self.num_emitted / max(self.verify_steps, 1)

    @property
    def stats(self) -> dict:
        return {"verify_steps": self.verify_steps, "tokens_per_step": self.tokens_per_step, **self.timing}


class Engine:
    """One model on one device (see ``EngineConfig``); ``trace`` keeps every verify step's record."""

    def __init__(self, config: EngineConfig, *, trace: bool = False, model: LoadedModel | None = None):
        self.model = model if model is not None else load_model(config)
        cfg = self.model.config
        self.config = cfg
        self.tokenizer = self.model.tokenizer
        self.runner = ModelRunner(self.model.target, self.model.pools, self.model.proposer, page_size=cfg.page_size,
                                  device=self.model.pools.device, trace=trace)
        self.stop_ids = frozenset(self.model.stop_token_ids)
        self._next_id = 0

    @property
    def num_steps(self) -> int | None:
        return self.model.num_steps or None

    def new_scheduler(self) -> Scheduler:
        cfg = self.config
        return Scheduler(max_running_req=cfg.max_running_req, max_num_batched_tokens=cfg.max_num_batched_tokens,
                         page_size=cfg.page_size, num_pages=self.model.memory.num_pages,
                         num_steps=self.model.num_steps, max_model_len=self.model.max_model_len)

    # ---- requests -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"{self.config.model_path}: no tokenizer files, so a text prompt cannot be encoded "
                               "(give token ids instead)")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | dict) -> Req:
        """A request, or a finished one holding its error (never raises for a bad request)."""
        rid, self._next_id = self._next_id, self._next_id + 1
        req = Req(rid, [], params if isinstance(params, SamplingParams) else SamplingParams(), 0,
                  arrival_s=time.perf_counter())
        try:
            req.params = self._check_params(params)
            req.prompt_ids = self._check_ids(self.encode(prompt) if isinstance(prompt, str) else prompt)
            req.max_new_tokens = self._check_length(req.prompt_ids, req.params)
            if req.params.stop and self.tokenizer is None:
                raise RequestError(f"stop={list(req.params.stop)!r}: expected no stop strings for a checkpoint "
                                   "without a tokenizer (they are matched on decoded text)")
        except UserInputError as exc:
            req.finish_reason, req.error = "error", str(exc)
        return req

    @staticmethod
    def _check_params(params) -> SamplingParams:
        if isinstance(params, dict):
            try:
                return SamplingParams(**params)
            except TypeError as exc:
                raise RequestError(f"sampling params {params!r}: {exc}") from None
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params {params!r}: expected a SamplingParams")
        params.validate()  # again: a frozen dataclass can still be forced
        return params

    def _check_ids(self, prompt) -> list[int]:
        vocab = self.model.target_cfg.vocab_size
        try:
            ids = list(prompt)
        except TypeError:
            raise RequestError(f"prompt {prompt!r}: expected text or a list of token ids") from None
        if not ids:
            raise RequestError("prompt: expected at least one token, got an empty prompt")
        bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]}: expected integers in [0, {vocab})")
        return ids

    def _check_length(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The reference's context check, then the engine's max_model_len; returns max_new_tokens."""
        context = self.model.target_cfg.max_position_embeddings
        total = len(prompt_ids) + params.max_tokens
        if total > context:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total}: expected at most "
                f"the model's context of {context} tokens")
        limit = self.model.max_model_len
        if len(prompt_ids) >= limit:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens): expected fewer than max_model_len={limit}")
        return min(params.max_tokens, limit - len(prompt_ids))

    # ---- the loop -------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: Sequence[SamplingParams | dict]) -> list[RequestOutput]:
        if len(prompts) != len(params):
            raise UserInputError(f"{len(prompts)} prompts and {len(params)} sampling params: expected one each")
        scheduler = self.new_scheduler()
        reqs = [self.make_request(p, sp) for p, sp in zip(prompts, params)]
        for req in reqs:
            if req.error is None:
                scheduler.add(req)
        while scheduler.has_work:
            self.step(scheduler)
        return [self._output(req) for req in reqs]

    def step(self, scheduler: Scheduler) -> None:
        plan = scheduler.schedule()
        assert plan is not None, "requests wait but none can be admitted or run"
        if isinstance(plan, PrefillPlan):
            firsts = self.runner.prefill(plan)
            for chunk, token in zip(plan.chunks, firsts):
                chunk.req.num_prefilled += chunk.length
                if token is not None:
                    chunk.req.first_token_s = time.perf_counter()
                    self._commit(scheduler, chunk.req, [token])
        elif self.model.num_steps:
            for req, result in zip(plan.reqs, self.runner.verify(plan)):
                req.num_verify_steps += 1
                req.num_emitted += len(result.emitted)
                if result.trace is not None:
                    req.steps.append(result.trace)
                self._commit(scheduler, req, result.emitted)
        else:
            for req, token in zip(plan.reqs, self.runner.decode(plan)):
                self._commit(scheduler, req, [token])

    def _commit(self, scheduler: Scheduler, req: Req, tokens: list[int]) -> None:
        """Append committed tokens and end the request where the reference would (``reference/request/stopping.py``)."""
        decode = self.decode if self.tokenizer is not None else None
        stopper = Stopper(req.params, self.stop_ids, decode, req.max_new_tokens)
        req.output_ids, reason = stopper.check(req.output_ids + tokens)
        if reason is not None:
            req.text = stopper.final_text(req.output_ids)
            req.finish_s = time.perf_counter()
            scheduler.finish(req, reason)

    def _output(self, req: Req) -> RequestOutput:
        timing = {}
        if req.error is None:
            total = req.finish_s - req.arrival_s
            prefill = req.first_token_s - req.arrival_s
            timing = {"prefill_s": prefill, "decode_s": total - prefill, "total_s": total,
                      "output_tokens_per_s": len(req.output_ids) / total if total > 0 else 0.0}
        return RequestOutput(req.rid, list(req.prompt_ids), list(req.output_ids), req.text,
                             req.finish_reason, req.error, req.num_verify_steps,
                             req.num_emitted, timing, list(req.steps))
