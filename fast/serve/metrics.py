"""The server's Prometheus metrics (``GET /metrics``), in one registry per server.

Updated from two threads, both safe with ``prometheus_client``: the engine thread after every step
(queue gauges, pool gauges, generated tokens, speculation, a request's queue and prefill times) and the
event loop as each request's tokens reach it (time to first token, time per output token, end-to-end
latency, finish reasons).

Speculation, per verify step of one request that drafted k tokens and kept a of them:
``spec_decode_num_draft_tokens += k``, ``spec_decode_num_accepted_tokens += a``,
``spec_decode_num_accepted_tokens_per_pos{position=i} += 1`` for i = 1..a (draft i was accepted), and
``spec_decode_tokens_per_verify_step`` observes a + 1 (the tokens the step committed).
"""

from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.engine import Engine, RequestDelta

PREFIX = "dflash2_"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServeMetrics:
    def __init__(self, model_name: str, k: int = 0):
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, label, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, label, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests admitted to the engine (holding a state slot)")
        self.waiting = gauge("num_requests_waiting", "Requests queued for admission")
        self.kv_pages_free = gauge("kv_pages_free", "KV cache pages on the free list")
        self.kv_pages_total = gauge("kv_pages_total", "KV cache pages")
        self.state_slots_free = gauge("state_slots_free", "GDN state slots free (one per running request)")
        self.prefix_pages = gauge("prefix_cache_pages", "KV pages the prefix cache holds")
        self.prefix_snapshots = gauge("prefix_cache_snapshots", "Prefix-cache snapshots kept (GDN and draft state)")
        # vLLM's units: prompt tokens looked up at admission, and of those, tokens restored from the cache
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens restored from the prefix cache")
        self.prefix_evictions = counter("prefix_cache_evictions", "Prefix-cache snapshots evicted (LRU)")
        self._prefix_seen = (0, 0, 0)  # the cache's counters at the last step
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time between a request's tokens after the "
                              "first", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token", LATENCY_BUCKETS)
        # TTFT's two parts inside the engine (vLLM's names): waiting for admission, then the first prefill step's
        # start to the first token (a prefix-cache hit's restore and the prompt's prefill chunks)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival in the engine to its first prefill step",
                                    LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First prefill step's start to the first "
                                      "token (restore and prefill chunks)", LATENCY_BUCKETS)
        self._finished = Counter(PREFIX + "request_finished", "Requests finished, by finish reason",
                                 label + ["finish_reason"], registry=r)
        self._rejected = Counter(PREFIX + "request_rejected", "HTTP requests refused, by status code",
                                 label + ["status"], registry=r)
        self.model_name = model_name
        self.spec_drafts = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_steps = counter("spec_decode_num_verify_steps", "Per-request verify steps")
        self._accepted_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Verify steps whose draft at this position was accepted",
                                     label + ["position"], registry=r)
        self.spec_tokens_per_step = histogram("spec_decode_tokens_per_verify_step", "Tokens committed by one "
                                              "request's verify step (accepted drafts + 1)",
                                              tuple(float(i) for i in range(1, max(k, 1) + 2)))
        for reason in ("stop", "length", "abort", "error"):
            self._finished.labels(model_name, reason)
        for position in range(1, k + 1):
            self._accepted_pos.labels(model_name, str(position))

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def on_step(self, engine: Engine, deltas: Sequence[RequestDelta]) -> None:
        """Engine thread, after a step."""
        usage = engine.pool_usage(check=False)
        self.running.set(usage.running)
        self.waiting.set(usage.waiting)
        self.kv_pages_free.set(usage.free_pages)
        self.kv_pages_total.set(usage.total_pages)
        self.state_slots_free.set(usage.free_slots)
        self.prefix_pages.set(usage.cached_pages)
        self.prefix_snapshots.set(usage.snapshots)
        cache = engine.prefix_cache
        if cache is not None:
            now = (cache.stats.queries, cache.stats.hits, cache.stats.evictions)
            for metric, new, old in zip((self.prefix_queries, self.prefix_hits, self.prefix_evictions), now,
                                        self._prefix_seen):
                if new > old:
                    metric.inc(new - old)
            self._prefix_seen = now
        tokens = 0
        for d in deltas:
            tokens += len(d.token_ids)
            if d.queue_s is not None:
                self.queue_time.observe(d.queue_s)
                self.prefill_time.observe(d.prefill_s)
            if d.num_accepted is not None:
                self.spec_steps.inc()
                self.spec_drafts.inc(d.k)
                self.spec_accepted.inc(d.num_accepted)
                self.spec_tokens_per_step.observe(d.num_accepted + 1)
                for position in range(1, d.num_accepted + 1):
                    self._accepted_pos.labels(self.model_name, str(position)).inc()
        if tokens:
            self.generation_tokens.inc(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
