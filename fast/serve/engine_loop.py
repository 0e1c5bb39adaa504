"""The engine on its own thread beside the event loop, so a long step never blocks ``/health``.

One thread owns the :class:`Engine` and is the only one to touch it. The event loop talks to it
through a command queue and hears back through ``loop.call_soon_threadsafe``::

    event loop                                 engine thread
    submit(reqs) -> RequestGroup  --add-->     engine.add(req)               (queued, then admitted)
    group.abort() (client gone)   --abort-->   engine.abort(rid)             (slot, pages, ring back)
    call(fn)                      --call-->    fn(engine)                    (e.g. pool_usage)
                                               while work: deltas = engine.step()
    RequestGroup.queue            <--deltas--  one call_soon_threadsafe per step

A step that raises fails the requests it ran (``Engine.fail_running``) and the loop goes on; the
waiting requests are untouched. The number of requests in flight (submitted, not yet finished) is
bounded by ``max_running_req + max_queued``: ``submit`` raises :class:`QueueFull` past it (a 429).
``stop`` ends the thread after aborting whatever is left (the server drains before calling it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dflash2.reference.formats.errors import RequestError

from ..engine.engine import Engine, RequestDelta
from ..engine.scheduler import Req
from .metrics import ServeMetrics

logger = logging.getLogger("dflash2.fast.serve")


class QueueFull(Exception):
    """More requests in flight than the server queues."""


class EngineStopped(Exception):
    """The engine thread is stopping or has died."""


@dataclass
class _Timing:
    arrival_s: float
    first_token_s: float | None = None
    num_tokens: int = 0


class RequestGroup:
    """The engine requests of one HTTP request (prompts x n choices): their deltas, in the order the
    engine produced them, as ``(index, delta)``; ``index`` is the member's position in ``submit``."""

    def __init__(self, owner: EngineLoop, rids: Sequence[int]):
        self.owner = owner
        self.rids = list(rids)
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.queue: asyncio.Queue[tuple[int, RequestDelta]] = asyncio.Queue()
        self.live = set(rids)  # not yet finished, as seen by the event loop (what abort still has to end)
        self.timing = {rid: _Timing(time.perf_counter()) for rid in rids}

    async def deltas(self):
        """Every delta of every member, until each has finished."""
        remaining = len(self.rids)
        while remaining:
            index, delta = await self.queue.get()
            remaining -= delta.finished
            yield index, delta

    def abort(self) -> None:
        """End the members that have not finished (the client went away); idempotent."""
        for rid in list(self.live):
            self.owner.abort(rid)


class EngineLoop:
    def __init__(self, engine: Engine, *, max_queued: int, metrics: ServeMetrics | None = None):
        if not (isinstance(max_queued, int) and max_queued >= 0):
            raise ValueError(f"max_queued={max_queued!r}: expected an integer >= 0")
        self.engine, self.metrics = engine, metrics
        self.capacity = engine.config.max_running_req + max_queued
        self.in_flight = 0  # event loop only
        self.error: BaseException | None = None  # what killed the engine thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: dict[int, RequestGroup] = {}  # engine thread only
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="dflash2-engine", daemon=True)

    # ---- event loop side ------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.error is None

    def submit(self, reqs: Sequence[tuple[Req, int | None]]) -> RequestGroup:
        """Queue validated requests (``Engine.new_request``) with their ``top_logprobs``; event loop only."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        if self.in_flight + len(reqs) > self.capacity:
            raise QueueFull(f"{self.in_flight} requests in flight + {len(reqs)}: the server takes at most "
                            f"{self.capacity} (--max-running-requests + --max-queued-requests)")
        group = RequestGroup(self, [req.rid for req, _ in reqs])
        self.in_flight += len(reqs)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(req.prompt_len for req, _ in reqs))
        self._commands.put(("add", [(req, n, group) for req, n in reqs]))
        return group

    def abort(self, rid: int) -> None:
        self._commands.put(("abort", rid))

    def call(self, fn: Callable[[Engine], object]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread, between steps; any thread may wait on the future
        (``asyncio.wrap_future`` it in the event loop)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():
            future.set_exception(EngineStopped("the engine thread is not running"))
            return future
        self._commands.put(("call", (fn, future)))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left and end the thread (blocking: call it from a worker thread)."""
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    def _deliver(self, batch: list[tuple[RequestGroup, RequestDelta]]) -> None:
        now = time.perf_counter()
        for group, delta in batch:
            timing = group.timing[delta.request_id]
            if delta.token_ids and timing.first_token_s is None:
                timing.first_token_s = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - timing.arrival_s)
            timing.num_tokens += len(delta.token_ids)
            if delta.finished:
                group.live.discard(delta.request_id)
                self.in_flight -= 1
                if self.metrics is not None:
                    self._observe_finish(timing, delta, now)
            group.queue.put_nowait((group.index[delta.request_id], delta))

    def _observe_finish(self, timing: _Timing, delta: RequestDelta, now: float) -> None:
        self.metrics.finished(delta.finish_reason)
        if delta.finish_reason in ("stop", "length"):
            self.metrics.e2e.observe(now - timing.arrival_s)
            if timing.num_tokens > 1 and timing.first_token_s is not None:
                self.metrics.tpot.observe((now - timing.first_token_s) / (timing.num_tokens - 1))

    # ---- engine thread --------------------------------------------------------------------------

    def _send(self, batch: list[tuple[RequestGroup, RequestDelta]]) -> None:
        if batch:
            try:
                self._loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

    def _next_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _run(self) -> None:
        engine = self.engine
        try:
            bind_thread_to(engine.model.pools.device)
            while True:
                out: list[tuple[RequestGroup, RequestDelta]] = []
                stop = False
                for kind, arg in self._next_commands(block=not engine.has_unfinished):
                    if kind == "add":
                        for req, top_logprobs, group in arg:
                            try:
                                engine.add(req, top_logprobs=top_logprobs)
                                self._groups[req.rid] = group
                            except RequestError as exc:
                                out.append((group, RequestDelta(req.rid, [], True, "error", error=str(exc))))
                    elif kind == "abort":
                        delta = engine.abort(arg)
                        if delta is not None:
                            out.append((self._groups.pop(arg), delta))
                    elif kind == "call":
                        fn, future = arg
                        try:
                            future.set_result(fn(engine))
                        except Exception as exc:  # noqa: BLE001 - handed to the caller
                            future.set_exception(exc)
                    elif kind == "stop":
                        stop = True
                if stop:
                    out += self._end_all("abort", None)
                    self._send(out)
                    return
                if engine.has_unfinished:
                    out += self._step()
                self._send(out)
        except BaseException as exc:  # the thread must not die silently: every request hears of it
            self.error = exc
            logger.critical("the engine thread died", exc_info=exc)
            self._send(self._end_all("error", f"the engine stopped: {type(exc).__name__}: {exc}"))

    def _step(self) -> list[tuple[RequestGroup, RequestDelta]]:
        engine = self.engine
        try:
            deltas = engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad step fails the requests in it, not the server
            if engine.workers is not None:  # tensor parallelism: the other ranks may be mid-collective: fatal
                raise
            logger.exception("an engine step failed; failing the requests it ran")
            message = f"internal error in an engine step: {type(exc).__name__}: {exc}"
            deltas = engine.fail_running(message)
            if not deltas:  # nothing was running: the waiting requests are what cannot proceed
                deltas = [d for rid in list(self._groups) if (d := engine.abort(rid, "error", message))]
        if self.metrics is not None:
            self.metrics.on_step(engine, deltas)
        out = []
        for delta in deltas:
            group = self._groups.pop(delta.request_id) if delta.finished else self._groups[delta.request_id]
            out.append((group, delta))
        return out

    def _end_all(self, reason: str, error: str | None) -> list[tuple[RequestGroup, RequestDelta]]:
        out = []
        for rid in list(self._groups):
            delta = None
            try:
                delta = self.engine.abort(rid, reason, error)
            except Exception:  # noqa: BLE001 - ending the others matters more
                logger.exception("request %d: abort failed", rid)
            out.append((self._groups.pop(rid), delta or RequestDelta(rid, [], True, reason, error=error)))
        return out


def bind_thread_to(device: torch.device) -> None:
    """Make the calling (engine) thread's current CUDA device the engine's.

    A new thread starts on device 0; an engine on ``cuda:N`` lives elsewhere. A bare ``cuda``
    names no index (``set_device`` refuses it) and means the current device, already right.
    """
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
