"""The engine loop: requests in, one scheduled step at a time, ``RequestOutput`` s out.

``Engine.generate`` validates each request alone (a bad one gets its error in its output and never
touches the batch), queues the rest, and steps until every request is finished:

    plan = scheduler.schedule()          a prefill plan (prompt chunks) or a decode plan (all running)
    tokens = runner.prefill / decode / verify(plan)
    commit: append the tokens, check stop ids, stop strings, max_tokens; finish and free resources

The same loop, one step at a time, is the incremental API a server drives (``fast/serve/``):

    rid = engine.add_request(prompt, params, top_logprobs=None)   validated now: RequestError if bad
    deltas = engine.step()        per request touched by the step: new token ids (after the stop cut),
                                  their logprobs when asked for, finished and finish_reason
    engine.abort(rid)             finish it now ("abort"): slot, pages and reservation go back exactly
                                  as at a normal finish (the DFlash ring and MTP state are per slot)
    engine.pool_usage()           free pages, slots and ring slots, checked for leaks and double frees

``generate`` runs on that API (its requests are added, then ``step`` runs until they finish), so the
two share one scheduler; it needs an engine with no incremental requests in flight.

Prefix caching (``EngineConfig.prefix_caching``, ``prefix_cache.py``): the scheduler admits a request on the
longest cached snapshot of its prompt, and the step's plan carries the restores, which run before its forward
(``snapshots.py``: the snapshot's GDN and proposer state into the request's slot, one page copied). After a
prefill step, a chunk that ended at a multiple of ``snapshot_interval`` is snapshotted; a request that finishes
(stop or length) with its state exactly at its frontier is snapshotted before its pages and slot go back, so the
next turn of a conversation resumes after all of it. Not at its frontier: a stop cut inside a step's tokens
(the state ran past the cut), or, with overlap scheduling, a next step already launched with the request (it
has moved the state on): there the request's latest checkpoint becomes its snapshot (``checkpoints.py``: taken
every 64 tokens where the host consents to launching a step ahead), so the next turn resumes shortly before the
end of this one.

Overlap scheduling (``EngineConfig.overlap_schedule``, ``runner.py``): a steady speculative step may launch the
next step of the same requests before its own tokens are read; the next ``step`` call then collects that one
(possibly launching the one after it) instead of scheduling, and commits its tokens for the requests still live
(one that ended or was aborted meanwhile has its rows dropped). The tokens are the same either way. An exception in
committing one request's tokens fails that request alone (finish reason "error"); an exception in a
step's forward leaves the caller to decide (``fail_running``).
"""

from __future__ import annotations


import functools
import itertools
import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Sequence

from dflash2.reference.formats.errors import ConfigError, RequestError, UserInputError
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.request.stopping import Stopper
from dflash2.reference.request.trace import StepRecord

from .config import EngineConfig
from ..speculative.depth import depth_policy
from ..speculative.step import SpeculativeStep
from .checkpoints import Checkpoints
from .graphs.graph_step import TargetGraphs
from .graphs.prefill_graphs import PrefillGraphs
from .logprobs import TokenLogprob
from .prefix_cache import PrefixCache
from .runner import ModelRunner
from .scheduler import PrefillPlan, Req, ReqStatus, Restore, Scheduler, pages_for
from .startup import LoadedModel, check_tp_target, load_model
from .tp.workers import MirroredSnapshots, start_workers

logger = logging.getLogger("dflash2.fast.engine")
MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's bound)


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None  # why the request was refused (finish_reason "error", no tokens)
    verify_steps: int = 0  # speculative steps (0 for plain decoding)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
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


@dataclass(frozen=True)
class RequestDelta:
    """What one step did to one request (``Engine.step``)."""

    request_id: int
    token_ids: list[int]  # tokens committed by this step, cut where the request ended
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked for them
    k: int = 0  # drafts verified for this request by this step (speculative steps)
    num_accepted: int | None = None  # of those, accepted (None: not a verify step)
    error: str | None = None  # finish_reason "error": why
    text: str | None = None  # the final text (stop strings cut), once finished
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (OpenAI usage's cached_tokens)
    # on the delta of a request's first token: arrival to its first prefill step, and that step's start to the
    # first token (the restore of a prefix-cache hit, the prefill chunks; they sum to the engine's TTFT)
    queue_s: float | None = None
    prefill_s: float | None = None


@dataclass(frozen=True)
class PoolUsage:
    """Cache resources at one moment; an idle engine has everything free and nothing reserved."""

    total_pages: int
    free_pages: int  # KV pages on the free list
    reserved_pages: int  # of those, promised to admitted requests
    total_slots: int  # GDN state slots (one per running request)
    free_slots: int
    total_ring_slots: int  # the proposer's per-slot states' slots (DFlash: ring and window; 0: none kept)
    free_ring_slots: int
    running: int
    waiting: int
    cached_pages: int = 0  # pages the prefix cache holds (some may be shared with running requests)
    snapshots: int = 0  # prefix-cache snapshots kept
    total_snapshots: int = 0  # prefix-cache snapshot slots

    def without_cache(self) -> PoolUsage:
        """This usage as if the prefix cache were dropped (at idle: every page free), to compare across steps."""
        return replace(self, free_pages=self.free_pages + self.cached_pages, cached_pages=0, snapshots=0)

    @property
    def idle(self) -> bool:
        """Nothing runs, waits or is reserved; every page is free or held by the prefix cache alone."""
        return (self.free_pages + self.cached_pages == self.total_pages and self.reserved_pages == 0 and
                self.free_slots == self.total_slots and self.free_ring_slots == self.total_ring_slots
                and not self.running and not self.waiting)


class Engine:
    """One model on one device (see ``EngineConfig``); ``trace`` keeps every verify step's record."""

    def __init__(self, config: EngineConfig, *, trace: bool = False, model: LoadedModel | None = None):
        self.workers = None  # tensor_parallel_size > 1: ranks 1.. (tp/workers.py's TPWorkers); this process is rank 0
        if model is None and config.tensor_parallel_size > 1:
            check_tp_target(config)  # refusals before any process starts
            self.workers = start_workers(config.resolved())
            weakref.finalize(self, self.workers.close)  # a dropped engine stops its workers too
            try:
                model = load_model(config, tp=self.workers.tp)
            except BaseException as e:
                dead = self.workers.dead()
                self.workers.close(abort=True)  # a worker may wait in a startup collective rank 0 left
                if dead and not isinstance(e, ConfigError):  # rank 0 saw a broken collective: say whose fault
                    raise RuntimeError(f"tensor parallelism: {', '.join(dead)} failed at startup (its traceback is "
                                       "on stderr above)") from e
                raise
        self.model = model if model is not None else load_model(config)
        cfg = self.model.config
        self.config = cfg
        self.tokenizer = self.model.tokenizer
        graphs = None
        if not cfg.enforce_eager and self.model.target.capturable():
            graphs = TargetGraphs(self.model.target, self.model.pools, max_seqs=cfg.max_running_req,
                                  max_pages=pages_for(self.model.max_model_len, cfg.page_size))
        spec = None
        if self.model.proposer is not None:
            spec = SpeculativeStep(self.model.target, self.model.pools, self.model.proposer,
                                   side_stream=cfg.side_stream)
        self.runner = ModelRunner(self.model.target, self.model.pools, spec, page_size=cfg.page_size,
                                  device=self.model.pools.device, trace=trace, graphs=graphs,
                                  propose_ahead=cfg.propose_ahead, overlap=cfg.overlap_schedule,
                                  whole_step_graphs=self.workers is None)
        prefill_rows = min(cfg.prefill_graph_rows, cfg.max_num_batched_tokens)
        if graphs is not None and self.workers is None and prefill_rows:  # short prefill chunks replay too
            self.runner.prefill_graphs = PrefillGraphs(self.model.target, self.model.pools, self.model.proposer,
                                                       max_seqs=cfg.max_running_req, max_pages=graphs.max_pages,
                                                       max_rows=prefill_rows)
        if self.workers is not None:  # the workers mirror rank 0's forwards, commits and snapshot copies
            self.runner.eager.before_forward = self.workers.forward
            if graphs is not None:
                graphs.before_run = self.workers.graph_run
            if spec is not None:
                spec.before_commit = self.workers.commit
            if self.model.snapshots is not None:
                self.model.snapshots = MirroredSnapshots(self.model.snapshots, self.workers)
        # how deep each speculative step drafts (fast/speculative/depth.py); None for plain decoding
        self.depth = depth_policy(cfg.speculative_depth, self.model.k) if self.model.k else None
        # an adaptive depth runs steps of no drafts (k = 0) as a policy choice, so they replay a graph too
        self.runner.graph_plain_steps = self.depth is not None and self.depth.adaptive
        self.stop_ids = frozenset(self.model.stop_token_ids)
        self._ids = itertools.count()  # thread-safe: a server validates requests beside the engine thread
        self.scheduler = self.new_scheduler()
        self.checkpoints = None  # finish snapshots under overlap scheduling (checkpoints.py)
        if self.model.num_checkpoints:
            first = self.model.snapshots.num_snapshots - self.model.num_checkpoints
            self.checkpoints = Checkpoints(self.model.snapshots, first, self.model.num_checkpoints)
        self._collecting = False  # inside _collect: a step is in flight while the next one is consented to
        self._live: dict[int, Req] = {}  # requests added and not yet finished, by id
        self._top_logprobs: dict[int, int] = {}  # request id -> alternatives per token, for those that asked

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also run when the engine is collected)."""
        if self.workers is not None:
            self.workers.close()

    @property
    def k(self) -> int | None:
        return self.model.k or None

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def new_scheduler(self) -> Scheduler:
        cfg = self.config
        prefix = None
        if self.model.snapshots is not None:
            prefix = functools.partial(PrefixCache, page_size=cfg.page_size,
                                       num_slots=self.model.snapshots.num_snapshots - self.model.num_checkpoints,
                                       snapshot_interval=cfg.prefix_snapshot_interval,
                                       rewrites_last_row=cfg.speculative_algorithm == "mtp")
        return Scheduler(max_running_req=cfg.max_running_req, max_num_batched_tokens=cfg.max_num_batched_tokens,
                         page_size=cfg.page_size, num_pages=self.model.memory.num_pages,
                         k=self.model.k, max_model_len=self.model.max_model_len,
                         depth=self.depth.choose if self.depth is not None and self.depth.adaptive else None,
                         prefix_cache=prefix,
                         busy_chunk_rows=prefill.max_chunk_rows if (prefill := self.runner.prefill_graphs) else None)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix

    def clear_prefix_cache(self) -> int:
        """Drop every cached snapshot and the pages only they hold; how many were dropped."""
        cache = self.scheduler.prefix
        if cache is None:
            return 0
        before = cache.num_snapshots
        cache.clear()
        return before - cache.num_snapshots

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
        rid = next(self._ids)
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
        if self.scheduler.has_work:
            raise RuntimeError(f"generate: {len(self._live)} requests of add_request are in flight; expected an "
                               "idle engine (finish or abort them first)")
        reqs = [self.make_request(p, sp) for p, sp in zip(prompts, params)]
        for req in reqs:
            if req.error is None:
                self._enqueue(req)  # one that can never fit is finished with its error here
        while self.scheduler.has_work:
            self.step()
        self.step()  # a step still in flight (its requests all ended before it was read): collected, dropped
        return [self._output(req) for req in reqs]

    # ---- the incremental API --------------------------------------------------------------------

    def new_request(self, prompt: str | Sequence[int], params: SamplingParams | dict) -> Req:
        """A validated request, not yet queued; raises the RequestError of a bad one. Touches no engine
        state but the id counter, so a server may call it beside the thread that steps."""
        req = self.make_request(prompt, params)
        error = req.error if req.error is not None else self.scheduler.capacity_error(req)
        if error is not None:
            raise RequestError(error)
        return req

    def add(self, req: Req, *, top_logprobs: int | None = None) -> int:
        """Queue a request of :meth:`new_request`; ``top_logprobs`` (0..20) asks for logprobs with that
        many alternatives per token. Returns its id."""
        if top_logprobs is not None and not (isinstance(top_logprobs, int) and not isinstance(top_logprobs, bool)
                                             and 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"top_logprobs={top_logprobs!r}: expected None or an integer in "
                               f"[0, {MAX_TOP_LOGPROBS}]")
        if req.status is not ReqStatus.WAITING or req.rid in self._live:
            raise RequestError(f"request {req.rid}: expected a new request (it is {req.status.value} or queued)")
        error = self.scheduler.capacity_error(req)
        if error is not None:
            raise RequestError(error)
        if top_logprobs is not None:
            self._top_logprobs[req.rid] = top_logprobs
        self._enqueue(req)
        return req.rid

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | dict, *,
                    top_logprobs: int | None = None) -> int:
        """Validate and queue one request (RequestError if it is bad); its id."""
        return self.add(self.new_request(prompt, params), top_logprobs=top_logprobs)

    def _enqueue(self, req: Req) -> None:
        self.scheduler.add(req)
        if not req.finished:
            self._live[req.rid] = req

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def abort(self, rid: int, reason: str = "abort", error: str | None = None) -> RequestDelta | None:
        """End a queued or running request now, returning what a finish returns; None if it is not live."""
        req = self._live.get(rid)
        if req is None:
            return None
        self.scheduler.finish(req, reason, error)
        return self._finished(req, [], None)

    def fail_running(self, error: str) -> list[RequestDelta]:
        """Fail every admitted request (after a step raised: any of them may have caused it), and any step in
        flight with them; the waiting ones stay queued."""
        self.runner.drop_in_flight()
        return [self.abort(req.rid, "error", error) for req in list(self.scheduler.running)]

    def pool_usage(self, check: bool = True) -> PoolUsage:
        """Free and total pages, slots and ring slots. With ``check`` (O(pages)), raises RuntimeError on a
        leak or a double free: a page or slot both free and held, or neither."""
        sched = self.scheduler
        pages = sched.pages
        free_pages = list(pages.free_pages)
        held_slots = [r.slot for r in sched.running]
        proposer = self.model.proposer
        states = proposer.slot_states() if proposer is not None else ()
        ring_slots = max((state.num_slots for state in states), default=0)
        held_rings = len({s for s in held_slots if s < ring_slots})
        cache = sched.prefix
        usage = PoolUsage(pages.num_pages, len(free_pages), pages.reserved, sched.max_running_req,
                          len(sched.free_slots), ring_slots, ring_slots - held_rings, len(sched.running),
                          len(sched.waiting), cache.num_pages if cache is not None else 0,
                          cache.num_snapshots if cache is not None else 0, cache.num_slots if cache is not None else 0)
        if not check:  # the server reads this every step: no walk of the pages or the trie
            return usage
        cached = cache.held_pages() if cache is not None else []
        if len(set(cached)) != usage.cached_pages:
            raise RuntimeError(f"prefix cache: {len(set(cached))} pages held, {usage.cached_pages} counted")
        holders = Counter(p for r in sched.running for p in r.pages) + Counter(cached)
        if len(set(free_pages)) != len(free_pages) or set(free_pages) & set(holders):
            raise RuntimeError(f"KV pages: the free list ({len(free_pages)}) repeats a page or holds a held one")
        if len(free_pages) + len(holders) != pages.num_pages:
            raise RuntimeError(f"KV pages: {len(free_pages)} free + {len(holders)} held, expected each of the "
                               f"{pages.num_pages} pages exactly once")
        wrong = [p for p, n in holders.items() if pages.refs[p] != n]
        if wrong:
            p = wrong[0]
            raise RuntimeError(f"KV page {p}: {pages.refs[p]} references counted, {holders[p]} holders "
                               f"({len(wrong)} pages wrong)")
        if cache is not None and len(cache.free_slots) + cache.num_snapshots != cache.num_slots:
            raise RuntimeError(f"snapshot slots: {len(cache.free_slots)} free + {cache.num_snapshots} kept, expected "
                               f"{cache.num_slots}")
        reserved = sum(r.reserved_pages for r in sched.running)
        if reserved != pages.reserved:
            raise RuntimeError(f"KV pages: {pages.reserved} reserved, expected the running requests' {reserved}")
        free_slots = list(sched.free_slots)
        if sorted(free_slots + held_slots) != list(range(sched.max_running_req)):
            raise RuntimeError(f"state slots: free {sorted(free_slots)} + held {sorted(held_slots)}, expected each "
                               f"of the {sched.max_running_req} slots exactly once")
        return usage

    def step(self) -> list[RequestDelta]:
        """Run one scheduled step (or collect the one in flight); what it did to each request it touched (none
        if nothing waits or runs)."""
        scheduler = self.scheduler
        if self.runner.in_flight is not None:
            return self._collect()
        if not scheduler.has_work:
            return []
        plan = scheduler.schedule()
        assert plan is not None, "requests wait but none can be admitted or run"
        deltas = []
        if isinstance(plan, PrefillPlan):
            reqs = [chunk.req for chunk in plan.chunks]
            started = time.perf_counter()
            for req in reqs:
                if req.scheduled_s is None:
                    req.scheduled_s = started
            self._restore(plan.restores)
            firsts = self.runner.prefill(plan, top_logprobs=self._wanted_logprobs(reqs))
            logprobs = self.runner.logprobs or [None] * len(reqs)
            self._snapshot_boundaries(plan)
            for chunk, token, lp in zip(plan.chunks, firsts, logprobs):
                chunk.req.num_prefilled += chunk.length
                if token is not None:
                    req = chunk.req
                    req.first_token_s = time.perf_counter()
                    deltas.append(replace(self._commit(req, [token], lp),
                                          queue_s=req.scheduled_s - req.arrival_s,
                                          prefill_s=req.first_token_s - req.scheduled_s))
        elif self.model.k:
            started, captures = time.perf_counter(), self._captures()
            wanted = self._wanted_logprobs(plan.reqs)
            launch_next = self._launch_next if self.config.overlap_schedule and wanted is None else None
            results = self.runner.verify(plan, top_logprobs=wanted, launch_next=launch_next)
            seconds = time.perf_counter() - started if self._captures() == captures else None
            deltas = self._commit_verify(plan.reqs, plan.ks, results, seconds, self.runner.logprobs)
        else:
            tokens = self.runner.decode(plan, top_logprobs=self._wanted_logprobs(plan.reqs))
            logprobs = self.runner.logprobs or [None] * len(plan.reqs)
            for req, token, lp in zip(plan.reqs, tokens, logprobs):
                deltas.append(self._commit(req, [token], lp))
        scheduler.finished.clear()  # the engine hands finished requests back itself; keep the scheduler bounded
        return deltas

    # ---- the prefix cache -------------------------------------------------------------------------

    def _restore(self, restores: Sequence[Restore]) -> None:
        """Before a prefill step: the hits' copied pages, then their snapshots' state into their slots."""
        if not restores:
            return
        copies = [r for r in restores if r.copy_src is not None]
        snapshots = self.model.snapshots
        snapshots.copy_pages([r.copy_src for r in copies], [r.copy_dst for r in copies])
        snapshots.load([r.snapshot_slot for r in restores], [r.req.slot for r in restores],
                       [r.length for r in restores])
        self.scheduler.prefix.unpin_all()

    def _snapshot_boundaries(self, plan: PrefillPlan) -> None:
        """After a prefill step: snapshot each request whose chunk ended at a multiple of snapshot_interval."""
        cache = self.scheduler.prefix
        if cache is None:
            return
        ends = [(c.req, c.start + c.length) for c in plan.chunks]
        self._snapshot([(req, req.prompt_ids[:end]) for req, end in ends if end % cache.snapshot_interval == 0])

    def _snapshot(self, items: Sequence[tuple[Req, list[int]]]) -> None:
        """Snapshot each request's state as the state after ``tokens`` (not already kept); one batched copy."""
        cache = self.scheduler.prefix
        slots, saved, taken = [], [], []
        for req, tokens in items:
            kept = cache.find(tokens)
            if kept is not None:
                cache.lru.move_to_end(kept)
                continue
            slot = cache.take_slot()
            if slot is None:
                continue
            taken.append(cache.insert(tokens, req.pages, slot))
            cache.pinned.add(taken[-1])  # a later take_slot of this batch must not evict it before the copy
            slots.append(req.slot)
            saved.append(slot)
        self.model.snapshots.save(slots, saved)
        cache.pinned.difference_update(taken)

    def _at_frontier(self, req: Req) -> bool:
        """Whether no step in flight (overlap scheduling) has moved the request's state on."""
        flight = self.runner.in_flight
        return flight is None or all(r is not req for r in flight.reqs)

    def _collect(self) -> list[RequestDelta]:
        """Commit the step in flight (overlap scheduling) for its requests still live; it may launch the next."""
        flight = self.runner.in_flight
        started, captures = time.perf_counter(), self._captures()
        self._collecting = True
        try:
            results = self.runner.collect(self._launch_next)
        finally:
            self._collecting = False
        seconds = time.perf_counter() - started if self._captures() == captures else None
        live = [(req, result) for req, result in zip(flight.reqs, results) if not req.finished]
        deltas = self._commit_verify([req for req, _ in live], [flight.k] * len(live), [r for _, r in live], seconds)
        self.scheduler.finished.clear()
        return deltas

    def _launch_next(self, reqs: Sequence[Req], k: int) -> bool:
        """Overlap scheduling's consent to launching the next step of ``reqs`` at depth k before this one is read
        (``runner.LaunchNext``): the scheduler would plan exactly that step (no request ended, mid-prompt or
        admissible) and the depth policy picks k for it (asked once per step either way); consenting, it allocates
        the pages the step can reach (below anchor + 2 (k + 1), within each request's reservation: the runner has
        checked every request has that many tokens to go)."""
        scheduler = self.scheduler
        if not scheduler.next_decodes(list(reqs)) or scheduler.choose_depth(len(reqs), ahead=True) != k:
            return False  # another depth: the next schedule() plans it, with the depth chosen here
        scheduler.take_depth()
        for req in reqs:
            self.scheduler.ensure_pages(req, req.anchor_position + 2 * (k + 1))
        if self.checkpoints is not None:  # queued before the step consented to: see checkpoints.py
            self.checkpoints.take(reqs, step_in_flight=self._collecting)
        return True

    def _captures(self) -> int:
        """CUDA graphs captured so far (decode and speculative steps): a step that adds one is no measure of its
        cost (the depth policy drops its time)."""
        return sum(len(g.graphs) for g in (self.runner.graphs, self.runner.step_graphs) if g is not None)

    def _commit_verify(self, reqs: Sequence[Req], ks: Sequence[int], results, seconds: float | None,
                       logprobs: list | None = None) -> list[RequestDelta]:
        """A speculative step's results: the depth policy's record (``seconds`` None: the step's time is no measure
        of its cost), then each request's committed tokens."""
        if reqs:
            self.depth.record(len(reqs), max(ks), seconds, ks, [r.num_accepted for r in results])
        deltas = []
        for req, k, result, lp in zip(reqs, ks, results, logprobs or [None] * len(reqs)):
            req.num_verify_steps += 1
            req.num_emitted += len(result.emitted)
            if result.trace is not None:
                req.steps.append(result.trace)
            deltas.append(self._commit(req, result.emitted, lp, k, result.num_accepted))
        return deltas

    def _wanted_logprobs(self, reqs: Sequence[Req]) -> list[int | None] | None:
        """The runner's ``top_logprobs`` argument: None (the default path) unless a request asked."""
        if not self._top_logprobs:
            return None
        wanted = [self._top_logprobs.get(r.rid) for r in reqs]
        return wanted if any(n is not None for n in wanted) else None

    def _commit(self, req: Req, tokens: list[int], logprobs: list[TokenLogprob] | None, k: int = 0,
                num_accepted: int | None = None) -> RequestDelta:
        """Append committed tokens and end the request where the reference would
        (``reference/request/stopping.py``); an exception here fails this request alone."""
        before = len(req.output_ids)
        try:
            decode = self.decode if self.tokenizer is not None else None
            stopper = Stopper(req.params, self.stop_ids, decode, req.max_new_tokens)
            req.output_ids, reason = stopper.check(req.output_ids + tokens, checked=before)
            if reason is not None:
                req.text = stopper.final_text(req.output_ids)
        except Exception as exc:  # noqa: BLE001 - a bug in one request's commit must not end the others
            logger.exception("request %d: committing its tokens failed", req.rid)
            req.output_ids = req.output_ids[:before]
            reason, req.error = "error", f"internal error while committing tokens: {type(exc).__name__}: {exc}"
        new = req.output_ids[before:]
        logprobs = None if logprobs is None else logprobs[:len(new)]
        if self.checkpoints is not None:
            self.checkpoints.resolve(req, at_output=len(new) == len(tokens))
        if reason is None:
            return RequestDelta(req.rid, new, logprobs=logprobs, k=k, num_accepted=num_accepted,
                                cached_tokens=req.cached_tokens)
        req.finish_s = time.perf_counter()
        if reason in ("stop", "length") and self.scheduler.prefix is not None:
            if len(new) == len(tokens) and self._at_frontier(req):
                # the state holds every committed token but the last (the anchor, at position f): the next turn of
                # this conversation resumes after all of it
                history = req.prompt_ids + req.output_ids
                self._snapshot([(req, history[:len(history) - 1])])
            elif self.checkpoints is not None:  # the state has moved on: resume from its latest checkpoint
                self.checkpoints.hand_over(req, self.scheduler.prefix)
        self.scheduler.finish(req, reason, req.error)
        return self._finished(req, new, logprobs, k, num_accepted)

    def _finished(self, req: Req, new: list[int], logprobs: list[TokenLogprob] | None, k: int = 0,
                  num_accepted: int | None = None) -> RequestDelta:
        """Forget a request the scheduler has just finished; its last delta."""
        self._live.pop(req.rid, None)
        if self.checkpoints is not None:
            self.checkpoints.forget(req)
        self._top_logprobs.pop(req.rid, None)
        if req.finish_s is None:
            req.finish_s = time.perf_counter()
        return RequestDelta(req.rid, new, True, req.finish_reason, logprobs, k, num_accepted, req.error,
                            req.text, req.cached_tokens)

    def _output(self, req: Req) -> RequestOutput:
        timing = {}
        if req.error is None:
            total = req.finish_s - req.arrival_s
            prefill = req.first_token_s - req.arrival_s
            timing = {"prefill_s": prefill, "decode_s": total - prefill, "total_s": total,
                      "output_tokens_per_s": len(req.output_ids) / total if total > 0 else 0.0}
        return RequestOutput(req.rid, list(req.prompt_ids), list(req.output_ids), req.text,
                             req.finish_reason, req.error, req.num_verify_steps, req.cached_tokens,
                             req.num_emitted, timing, list(req.steps))
