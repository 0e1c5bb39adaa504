"""Continuous batching: which requests run in the next step, and the pages and slots they hold.

A request's life (mini-sglang's, with a prefix cache for hybrid targets: ``prefix_cache.py``):

1. ``add``: validated requests wait in FIFO order (an invalid one is finished at once with its
   error, and never holds anything).
2. Admission, at the head of the queue only (no overtaking): a free GDN state slot and enough free
   KV pages for the request's whole budget, ``min(prompt + max_tokens, max_model_len)`` tokens.
   Reserving the budget up front means a running request never runs out of pages, so nothing is
   ever preempted; pages are still allocated lazily, as the context grows, out of the reservation.
   With a prefix cache, admission first looks up the longest cached snapshot of the prompt: the
   request shares its pages, reserves only the rest, starts its prefill past the hit and carries a
   :class:`Restore` in the plan (the runner copies the snapshot's state into its slot before the
   step's forward). When pages are short, least recently used snapshots are evicted, but only if
   that frees enough: a request never waits on pages eviction could free, and the cache is not
   emptied for a request that would wait anyway.
3. Prefill in chunks: a prefill step packs prompt chunks of admitted requests (unfinished ones
   first, in admission order, then newly admitted ones) up to ``max_num_batched_tokens`` rows.
   With a prefix cache a chunk also ends at every multiple of ``snapshot_interval``, where the
   engine snapshots the request's state.
4. Decode/verify steps: every request whose prompt is done contributes its anchor (the last
   committed token, not yet through the target) and ``k`` drafts. Prefill steps and decode steps
   are separate. While requests are decoding, a chunk has at most ``busy_chunk_rows`` rows (the engine's
   captured prefill steps' bound, so that step is one graph replay). A decoding request waits for at most one
   prefill step between two of its tokens:
   after a prefill step that stalled requests already decoding, they take a step before the next
   chunk, so a long prompt stalls them for one chunk at a time, never for its whole prefill. A
   prefill step stalls nobody when the only requests decoding are those whose first token it
   produced, so prompts that arrive while one is prefilled run next, back to back with it (a burst
   of arrivals does not wait for a decode step between its prefill steps). Otherwise a step is a
   prefill step whenever some admitted prompt is unfinished or a waiting request can be admitted.
5. Finish: a stop id (unless ``ignore_eos``), a stop string, ``max_tokens`` or ``max_model_len``
   (finish reason ``length``); the slot, the pages and the unused reservation return to the pools.

KV layout: the target's K/V for position p of a request lives at flat slot
``pages[p // page_size] * page_size + p % page_size``. A verify writes rows s..s+k; the rows of
rejected drafts stay in the request's pages as garbage past its context and are overwritten by the
next step's rows at the same positions; they never need freeing, because a request only ever
writes positions below its reserved budget (k is capped by the tokens it may still emit).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from dflash2.reference.request.sampling_params import SamplingParams

from .prefix_cache import PrefixCache


class ReqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Req:
    """One request's state, kept by the scheduler between steps."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # max_tokens, capped by max_model_len - len(prompt)
    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens already run through the target
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (not run through the target)
    slot: int = -1  # GDN state slot (also the MTP / DFlash per-request state)
    pages: list[int] = field(default_factory=list)
    reserved_pages: int = 0  # pages promised at admission and not yet allocated
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None
    text: str = ""
    steps: list = field(default_factory=list)  # StepRecords of the verify steps (when tracing)
    num_verify_steps: int = 0
    num_emitted: int = 0  # tokens committed by verify steps, before any cut at a stop
    arrival_s: float = 0.0
    scheduled_s: float | None = None  # when its first prefill step began (after waiting in the queue)
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled == self.prompt_len

    @property
    def anchor_position(self) -> int:
        """Position of the last committed token, the one not yet through the target (decode phase)."""
        return self.prompt_len + len(self.output_ids) - 1

    @property
    def budget_tokens(self) -> int:
        """The most positions this request can ever write: prompt plus every token it may emit."""
        return self.prompt_len + self.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED


@dataclass(frozen=True)
class PrefillChunk:
    req: Req
    start: int  # first prompt position of the chunk
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.req.prompt_len


@dataclass(frozen=True)
class Restore:
    """Before a request's first chunk: copy snapshot ``snapshot_slot`` (the state after ``length`` tokens) into
    its slot, and page ``copy_src`` into its private page ``copy_dst`` (None: nothing to copy)."""

    req: Req
    snapshot_slot: int
    length: int
    copy_src: int | None
    copy_dst: int | None


@dataclass(frozen=True)
class PrefillPlan:
    chunks: list[PrefillChunk]
    restores: list[Restore] = field(default_factory=list)  # run before the chunks (prefix-cache hits)


@dataclass(frozen=True)
class DecodePlan:
    reqs: list[Req]
    ks: list[int]  # k per request (0 for plain decoding)


class PageAllocator:
    """KV pages: a free list, with reservations counted against it, and a reference count per page.

    A page taken from the free list has one reference (the request that takes it); the prefix cache and
    requests resuming from it add references (``share``) and give them back (``drop``); a page returns
    to the free list when its last reference goes.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free_pages: deque[int] = deque(range(num_pages))
        self.refs = [0] * num_pages
        self.reserved = 0  # pages promised to admitted requests, not yet handed out

    @property
    def available(self) -> int:
        """Pages that a new admission may reserve."""
        return len(self.free_pages) - self.reserved

    def reserve(self, n: int) -> None:
        assert n <= self.available, f"reserving {n} pages with {self.available} available"
        self.reserved += n

    def take_reserved(self, n: int) -> list[int]:
        assert n <= self.reserved and n <= len(self.free_pages)
        self.reserved -= n
        pages = [self.free_pages.popleft() for _ in range(n)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def share(self, page: int) -> None:
        assert self.refs[page] > 0, f"sharing page {page}, which nobody holds"
        self.refs[page] += 1

    def drop(self, page: int) -> None:
        assert self.refs[page] > 0, f"dropping page {page}, which nobody holds"
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free_pages.append(page)

    def release(self, pages: list[int], unused_reservation: int) -> None:
        for page in pages:
            self.drop(page)
        self.reserved -= unused_reservation
        assert self.reserved >= 0 and len(self.free_pages) <= self.num_pages


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    """Queues, admission, chunking and resource accounting; no tensors (the runner builds those)."""

    def __init__(self, *, max_running_req: int, max_num_batched_tokens: int, page_size: int, num_pages: int,
                 k: int = 0, max_model_len: int, depth: Callable[[int], int] | None = None,
                 prefix_cache: Callable[[PageAllocator], PrefixCache] | None = None,
                 busy_chunk_rows: int | None = None):
        self.max_running_req = max_running_req
        self.max_num_batched_tokens = max_num_batched_tokens
        # while requests are decoding, a prompt's chunk has at most this many rows (None: no bound but the step's):
        # the engine's captured prefill steps take chunks that short (prefill_graphs.py), so the step between two
        # of their tokens is one replay, not a host-bound eager forward
        self.busy_chunk_rows = busy_chunk_rows
        self.page_size = page_size
        self.k = k  # k of a speculative step (its upper bound with an adaptive depth), 0 for plain decoding
        self.depth = depth  # the number of running requests -> this step's k (fast/speculative/depth.py); None: k
        self._chosen_depth: int | None = None  # a depth chosen ahead for the next step (choose_depth)
        self.max_model_len = max_model_len
        self.pages = PageAllocator(num_pages)
        # prefix_cache: builds the cache over this scheduler's pages (None: no prefix caching)
        self.prefix: PrefixCache | None = prefix_cache(self.pages) if prefix_cache is not None else None
        self._restores: list[Restore] = []  # hits admitted by the schedule() being planned
        # the last step planned was a prefill step while requests were decoding: they take the next step, so none
        # waits for two prefill steps between two of its tokens
        self._stalled_decodes = False
        self.free_slots: deque[int] = deque(range(max_running_req))
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, in admission order
        self.finished: list[Req] = []

    # ---- queue --------------------------------------------------------------------------------

    def capacity_error(self, req: Req) -> str | None:
        """Why this request could never be admitted, or None."""
        need = pages_for(req.budget_tokens, self.page_size)
        if need > self.pages.num_pages:
            return (f"prompt ({req.prompt_len} tokens) + max_tokens ({req.max_new_tokens}) needs {need} KV pages "
                    f"of {self.page_size} tokens: expected at most the {self.pages.num_pages} pages the cache holds")
        return None

    def add(self, req: Req) -> None:
        error = self.capacity_error(req)
        if error is not None:
            self.finish(req, "error", error)
            return
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -----------------------------------------------------------------------------

    def _can_admit(self, req: Req) -> bool:
        """Whether ``req`` fits now: a free slot and its pages (after what eviction would free). No side effects."""
        if not self.free_slots:
            return False
        hit = self.prefix.lookup(req.prompt_ids) if self.prefix is not None else None
        need = pages_for(req.budget_tokens, self.page_size) - (hit.num_shared if hit is not None else 0)
        if need <= self.pages.available:
            return True
        return self.prefix is not None and need <= self.pages.available + self.prefix.freeable_pages(hit)

    def _admit(self, req: Req) -> None:
        """Admit ``req`` (``_can_admit`` said it fits): its slot, its hit (shared pages, a Restore) and reservation."""
        hit = self.prefix.lookup(req.prompt_ids) if self.prefix is not None else None
        shared = hit.pages[:hit.num_shared] if hit is not None else []
        need = pages_for(req.budget_tokens, self.page_size) - len(shared)
        if self.prefix is not None:
            if hit is not None:
                self.prefix.use(hit, req.prompt_len)  # pinned: the eviction below keeps it
            else:
                self.prefix.count_miss(req.prompt_len)
            self.prefix.evict_until(need)
        req.slot = self.free_slots.popleft()
        for page in shared:
            self.pages.share(page)
        req.pages = list(shared)
        req.reserved_pages = need
        self.pages.reserve(need)
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        if hit is not None:
            copy_dst = None
            if hit.copy_page is not None:
                self.ensure_pages(req, (len(shared) + 1) * self.page_size)
                copy_dst = req.pages[-1]
            req.num_prefilled = req.cached_tokens = hit.length
            self._restores.append(Restore(req, hit.snapshot.slot, hit.length, hit.copy_page, copy_dst))

    def schedule(self) -> PrefillPlan | DecodePlan | None:
        """The next step: prompt chunks if any prompt can advance (unless the last step was a prefill step that
        stalled requests already decoding: their turn), else one decode/verify step for all that are decoding."""
        decoding = [r for r in self.running if r.prefill_done]
        if not (decoding and self._stalled_decodes):
            plan = self._schedule_prefill(self.busy_chunk_rows if decoding else None)
            if plan is not None:
                self._stalled_decodes = bool(decoding)
                return plan
        self._stalled_decodes = False
        if not decoding:
            return None
        k = self.choose_depth(len(decoding))
        ks = [self.drafts_for(r, k) for r in decoding]
        for req, k in zip(decoding, ks):
            self.ensure_pages(req, req.anchor_position + k + 1)
        return DecodePlan(decoding, ks)

    def choose_depth(self, num_seqs: int, ahead: bool = False) -> int:
        """The k of the next decode/verify step of ``num_seqs`` requests: the depth hook's choice (the scheduler's
        k without one). ``ahead``: asked before that step is planned (overlap scheduling); unless the caller then
        plans it itself (``take_depth``), :meth:`schedule` uses this choice instead of asking the hook again."""
        if self._chosen_depth is not None:
            k, self._chosen_depth = self._chosen_depth, None
        else:
            k = self.k if self.depth is None or not self.k else self.depth(num_seqs)
        if ahead:
            self._chosen_depth = k
        return k

    def take_depth(self) -> None:
        """The depth chosen ahead is the step the caller runs: :meth:`schedule` asks the hook afresh."""
        self._chosen_depth = None

    def next_decodes(self, reqs: list[Req]) -> bool:
        """Whether the next :meth:`schedule` would plan a decode/verify step of exactly ``reqs`` (still running,
        all the running requests, none mid-prompt, no waiting request admissible): what overlap scheduling
        needs to launch that step before this one's results are known."""
        return (len(self.running) == len(reqs) and not any(r.finished for r in reqs)
                and not (self.waiting and self._can_admit(self.waiting[0])))

    def drafts_for(self, req: Req, k: int | None = None) -> int:
        """This request's drafts in a step of depth k (default: the scheduler's k; ``reference/speculative/loop.py``):
        a step emits up to k + 1 tokens, so draft no further than the request's end; with one token left, none,
        and the step emits the target's own (bonus) token."""
        return min(self.k if k is None else k, req.max_new_tokens - len(req.output_ids) - 1)

    def _schedule_prefill(self, chunk_rows: int | None = None) -> PrefillPlan | None:
        """Chunks up to the step's budget, each at most ``chunk_rows`` rows (None: no bound of its own)."""
        budget = self.max_num_batched_tokens
        chunks = []
        for req in self.running:
            if budget == 0:
                break
            if not req.prefill_done:
                chunks.append(self._chunk(req, min(budget, chunk_rows or budget)))
                budget -= chunks[-1].length
        while budget > 0 and self.waiting and self._can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            self._admit(req)
            chunks.append(self._chunk(req, min(budget, chunk_rows or budget)))
            budget -= chunks[-1].length
        restores, self._restores = self._restores, []
        return PrefillPlan(chunks, restores) if chunks else None

    def _chunk(self, req: Req, budget: int) -> PrefillChunk:
        length = min(req.prompt_len - req.num_prefilled, budget)
        if self.prefix is not None:  # end at the next snapshot boundary
            interval = self.prefix.snapshot_interval
            length = min(length, (req.num_prefilled // interval + 1) * interval - req.num_prefilled)
        self.ensure_pages(req, req.num_prefilled + length)
        return PrefillChunk(req, req.num_prefilled, length)

    def ensure_pages(self, req: Req, num_tokens: int) -> None:
        """Allocate pages (from the request's reservation) until positions 0..num_tokens-1 have a home."""
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        if need > 0:
            assert need <= req.reserved_pages, f"request {req.rid} writes past its reserved budget"
            req.pages += self.pages.take_reserved(need)
            req.reserved_pages -= need

    # ---- results ------------------------------------------------------------------------------

    def finish(self, req: Req, reason: str, error: str | None = None) -> None:
        """Mark finished and return the slot, pages and reservation."""
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            self.free_slots.append(req.slot)
            self.pages.release(req.pages, req.reserved_pages)
        elif req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.pages, req.reserved_pages, req.slot = [], 0, -1
        req.status, req.finish_reason, req.error = ReqStatus.FINISHED, reason, error
        self.finished.append(req)
