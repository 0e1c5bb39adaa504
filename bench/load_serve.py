"""A bounded loopback load test of ``ft serve``: throughput and latency percentiles, as JSON and a table.

    python bench/load_serve.py --num-requests 256 --concurrency 32 --input-len 1024 --output-len 256 \\
        --out bench/results/<date>-<gpu>-serve/load.json -- \\
        --model bench/shapes/qwen3.5-27b --load-format dummy --max-running-requests 32

Everything after ``--`` is passed to ``ft serve`` (started here on 127.0.0.1, a free port, and stopped
with SIGTERM at the end, whose drain and exit status are recorded); or ``--url`` points at a server
already running on this machine.

Speculation under concurrency: ``--concurrency 1,8,32,64`` runs the load at each level in turn (each level
``--num-requests`` requests), and ``--compare-plain`` runs the same levels on a second server, the same ``ft
serve`` arguments with plain decoding (its speculative flags dropped), or ``--plain-url`` a running one: the
report gives each level's output tokens per second beside plain decoding's, and their ratio. ``--prompts FILE``
sends texts (``{"prompts": [...]}``, cycled) instead of random ids, so a trained pair accepts what it would in
use (``bench/prompts/python-8.json`` for the bundled pair). Only loopback addresses are accepted. The load is bounded twice:
at most ``--num-requests`` requests, none started after ``--duration-s``, and everything still open
at ``--duration-s + --timeout-s`` is cancelled. Each request is a streamed ``/v1/completions`` of
``--input-len`` random token ids (seeded; ids below ``--max-token-id``, so any vocabulary fits and
no tokenizer is needed) with ``ignore_eos`` and ``max_tokens = --output-len``, so every request
costs the same; ``--concurrency`` of them are in flight at once (a closed loop).

Per request: TTFT (send to the first token), TPOT ((last token - first token) / (tokens - 1)), ITL
(gaps between the events that carried tokens: with speculative decoding one event can carry several
tokens) and end-to-end latency. Reported: p50 / p90 / p99 / mean of each, request and output-token
throughput over the wall time of the load, and the server's own counters over the same window
(``/metrics``: prompt and generation tokens, verify steps, tokens per verify step). Random
(``--load-format dummy``) weights accept almost no drafts, so a speculative run there times the
serving path at about one token per verify step, not the speed-up of a trained draft.

A multi-turn chat workload for the prefix cache: ``--multi-turn`` replaces the uniform requests with
``--users`` conversations (default 8) of ``--turns`` turns each (default 6) that share one ``--system-len``
token system prompt (default 2000). User u's turn t prompt is the system prompt, then each earlier turn's
user message and the assistant's reply, then a new user message of ``--user-len`` tokens: the previous
prompt plus the previous reply's token ids (read from the stream: ``return_token_ids``) plus the new
message. The users run at once, each its turns one after another (a closed loop per user), so turn 1 of
every user arrives together and shares only the system prompt (which only a boundary snapshot inside it,
``ft serve --snapshot-interval`` below ``--system-len``, can serve, and only to a user admitted after that
snapshot was taken: ``--stagger-s S`` starts user u at u * S seconds). Every turn is a streamed
``/v1/completions`` of token ids with ``ignore_eos``, ``max_tokens = --output-len`` and the final usage
chunk (``stream_options.include_usage``), at ``--temperature`` 0 by default: greedy replies are a
function of the prompt, random ``--load-format dummy`` weights included (seeded: they give other ids than
trained weights, but the same ids run after run), so the users' messages (seeded by ``--seed``) and the
replies make the same histories on every server. ``--compare-no-cache`` runs the same conversations on a
second server, the same ``ft serve`` arguments plus ``--no-prefix-caching`` (or ``--no-cache-url`` a
running one), and counts the turns whose reply ids match (all of them on CPU in fp32; on a GPU another
batch or prefill split can flip a near-tie in bf16, and that conversation's later prompts then differ:
a warning says where). Reported per server: the hit rate (the sum of
``usage.prompt_tokens_details.cached_tokens`` over the sum of prompt tokens, and the same from the
``/metrics`` prefix-cache counters), prefill tokens computed (prompt minus cached), TTFT p50 / p99 overall,
for turn 1, for the later turns and per turn, TTFT's two parts inside the engine (the means of the
``/metrics`` queue-time and prefill-time histograms), tokens per verify step (the ``/metrics`` histogram's
sum over its count) and output tokens per second; with both servers, the cache's gain: without / with for
TTFT and prefill tokens, with / without for output tokens per second. Issue 33's workload, on the MoE
shape with dummy weights and on the bundled pair::

    python bench/load_serve.py --multi-turn --compare-no-cache --out bench/results/<date>-<gpu>-serve/multi-turn.json \\
        -- --model bench/shapes/qwen3.5-35b-a3b --speculative-algorithm dflash \\
        --speculative-draft-model-path bench/shapes/qwen3.5-35b-a3b-dflash2 --load-format dummy \\
        --max-running-requests 8 --max-model-len 4096
    python bench/load_serve.py --multi-turn --compare-no-cache -- --max-running-req 8

Standard library only (the client is a small HTTP/1.1 reader), so it runs wherever ``ft`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

LOOPBACK_NAMES = {"localhost"}


# ---- a minimal HTTP/1.1 client -----------------------------------------------------------------


async def http(host: str, port: int, method: str, path: str, body: dict | None = None, *,
               headers: dict[str, str] | None = None, on_data=None, timeout: float = 60.0) -> tuple[int, bytes]:
    """One request on its own connection; ``on_data(bytes)`` sees the body as it arrives (chunked or
    not). Returns (status, the whole body)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        payload = b"" if body is None else json.dumps(body).encode()
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
                 f"Content-Length: {len(payload)}", "Content-Type: application/json",
                 *(f"{k}: {v}" for k, v in (headers or {}).items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        response_headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        chunks = []

        def take(data: bytes) -> None:
            chunks.append(data)
            if on_data is not None:
                on_data(data)

        if response_headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                take(await reader.readexactly(size))
                await reader.readexactly(2)
        elif "content-length" in response_headers:
            take(await reader.readexactly(int(response_headers["content-length"])))
        else:
            take(await reader.read())
        return status, b"".join(chunks)
    finally:
        writer.close()


# ---- one request -------------------------------------------------------------------------------


@dataclass
class Sample:
    ok: bool
    status: int = 0
    error: str | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the generated ids, in order (with return_token_ids)
    usage: dict | None = None  # the final usage chunk (with stream_options.include_usage)


async def one_request(host: str, port: int, body: dict, headers: dict, timeout: float) -> Sample:
    start = time.perf_counter()
    token_times: list[tuple[float, int]] = []
    token_ids: list[int] = []
    usage: list[dict] = []
    buffer = b""
    errors: list[str] = []

    def on_data(data: bytes) -> None:
        nonlocal buffer
        buffer += data
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                continue
            event = json.loads(raw[6:])
            if "error" in event:
                errors.append(event["error"].get("message", "error"))
                continue
            if event.get("usage"):
                usage.append(event["usage"])
            ids = [t for c in event.get("choices", ()) for t in c.get("token_ids") or ()]
            if ids:
                token_times.append((time.perf_counter(), len(ids)))
                token_ids.extend(ids)

    try:
        status, raw = await asyncio.wait_for(http(host, port, "POST", "/v1/completions", body, headers=headers,
                                                  on_data=on_data, timeout=timeout), timeout)
    except (asyncio.TimeoutError, OSError, ValueError) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if status != 200 or errors:
        return Sample(False, status, errors[0] if errors else raw[:200].decode(errors="replace"))
    tokens = sum(n for _, n in token_times)
    sample = Sample(True, status, output_tokens=tokens, e2e_s=end - start, token_ids=token_ids,
                    usage=usage[-1] if usage else None)
    if token_times:
        first, last = token_times[0][0], token_times[-1][0]
        sample.ttft_s = first - start
        sample.tpot_s = (last - first) / (tokens - 1) if tokens > 1 else None
        sample.itl_s = [b - a for (a, _), (b, _) in zip(token_times, token_times[1:])]
    return sample


# ---- the load ----------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:  # linear interpolation between closest ranks
        pos = q * (len(ordered) - 1)
        low = int(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": sum(ordered) / len(ordered), "n": len(ordered)}


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            base, _, labels = name.partition("{")
            kept = [kv for kv in re.findall(r'\w+="[^"]*"', labels) if not kv.startswith("model_name=")]
            out[base + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
    return out


async def served_model(host: str, port: int, headers: dict) -> str:
    status, raw = await http(host, port, "GET", "/v1/models", headers=headers)
    if status != 200:
        raise SystemExit(f"GET /v1/models: status {status}: {raw[:200]!r}")
    return json.loads(raw)["data"][0]["id"]


async def read_metrics(host: str, port: int) -> dict[str, float]:
    return parse_metrics((await http(host, port, "GET", "/metrics"))[1].decode())


async def run_load(args: argparse.Namespace, host: str, port: int) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = await served_model(host, port, headers)
    rng = random.Random(args.seed)
    prompts = ([args.texts[i % len(args.texts)] for i in range(args.num_requests)] if args.texts else
               [[rng.randrange(args.max_token_id) for _ in range(args.input_len)] for _ in range(args.num_requests)])
    bodies = [{"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
               "ignore_eos": True, "stream": True, "return_token_ids": True, "seed": i}
              for i, prompt in enumerate(prompts)]
    before = await read_metrics(host, port)
    samples: list[Sample] = []
    next_index = 0
    start = time.perf_counter()
    stop_issuing = start + args.duration_s

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(bodies) and time.perf_counter() < stop_issuing:
            body = bodies[next_index]
            next_index += 1
            samples.append(await one_request(host, port, body, headers, args.timeout_s))

    workers = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
    done, pending = await asyncio.wait(workers, timeout=args.duration_s + args.timeout_s)
    for task in pending:
        task.cancel()
    cancelled = len(pending)
    wall = time.perf_counter() - start
    after = await read_metrics(host, port)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    ok = [s for s in samples if s.ok]
    output_tokens = sum(s.output_tokens for s in ok)
    steps = moved("dflash2_spec_decode_num_verify_steps_total")
    return {
        "model": model, "num_requests_sent": len(samples), "num_ok": len(ok), "num_failed": len(samples) - len(ok),
        "num_cancelled_at_deadline": cancelled, "errors": sorted({s.error for s in samples if s.error})[:10],
        "wall_s": wall, "request_throughput_per_s": len(ok) / wall, "output_tokens": output_tokens,
        "output_token_throughput_per_s": output_tokens / wall,
        "total_token_throughput_per_s": (output_tokens + moved("dflash2_prompt_tokens_total")) / wall,
        "ttft_s": percentiles([s.ttft_s for s in ok if s.ttft_s is not None]),
        "tpot_s": percentiles([s.tpot_s for s in ok if s.tpot_s is not None]),
        "itl_s": percentiles([x for s in ok for x in s.itl_s]),
        "e2e_s": percentiles([s.e2e_s for s in ok if s.e2e_s is not None]),
        "server": {
            "prompt_tokens": moved("dflash2_prompt_tokens_total"),
            "generation_tokens": moved("dflash2_generation_tokens_total"),
            "verify_steps": steps,
            "draft_tokens": moved("dflash2_spec_decode_num_draft_tokens_total"),
            "accepted_tokens": moved("dflash2_spec_decode_num_accepted_tokens_total"),
            "tokens_per_verify_step": (steps + moved("dflash2_spec_decode_num_accepted_tokens_total")) / steps
            if steps else None,
            "rejected_429": moved('dflash2_request_rejected_total{status="429"}'),
        },
    }


# ---- the multi-turn chat workload (--multi-turn) --------------------------------------------------


def conversation_script(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each user's messages (``[user][turn]``), seeded: the same for every server."""
    rng = random.Random(args.seed)
    system = [rng.randrange(args.max_token_id) for _ in range(args.system_len)]
    messages = [[[rng.randrange(args.max_token_id) for _ in range(args.user_len)] for _ in range(args.turns)]
                for _ in range(args.users)]
    return system, messages


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def turn_summary(turns: list[dict]) -> dict:
    """Hit rate, prefill tokens computed and TTFT percentiles over some turns (the ok ones)."""
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    return {"turns": len(turns), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tokens_computed": prompt - cached, "hit_rate": ratio(cached, prompt),
            "ttft_s": percentiles([t["ttft_s"] for t in turns if t["ttft_s"] is not None])}


async def run_multi_turn(args: argparse.Namespace, host: str, port: int) -> dict:
    """``--users`` conversations at once, each ``--turns`` turns in a row over a growing history."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = await served_model(host, port, headers)
    system, messages = conversation_script(args)
    before = await read_metrics(host, port)
    records: list[tuple[int, int, int, Sample]] = []  # (user, turn from 1, prompt length, sample)
    start = time.perf_counter()
    stop_issuing = start + args.duration_s

    async def user(u: int) -> None:
        await asyncio.sleep(u * args.stagger_s)
        history = list(system)
        for t in range(args.turns):
            if time.perf_counter() >= stop_issuing:
                return
            prompt = history + messages[u][t]
            body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
                    "ignore_eos": True, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}, "seed": u * args.turns + t}
            sample = await one_request(host, port, body, headers, args.timeout_s)
            records.append((u, t + 1, len(prompt), sample))
            if not sample.ok:
                return  # no reply, no next turn
            history = prompt + sample.token_ids

    tasks = [asyncio.ensure_future(user(u)) for u in range(args.users)]
    done, pending = await asyncio.wait(tasks, timeout=args.duration_s + args.timeout_s)
    for task in pending:
        task.cancel()
    wall = time.perf_counter() - start
    after = await read_metrics(host, port)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    turns = []
    for u, t, prompt_len, s in sorted(records, key=lambda r: r[:2]):
        usage = s.usage or {}
        turns.append({"user": u, "turn": t, "ok": s.ok, "error": s.error,
                      "prompt_tokens": usage.get("prompt_tokens", prompt_len),
                      "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                      "usage_reported": s.usage is not None, "output_tokens": s.output_tokens,
                      "ttft_s": s.ttft_s, "e2e_s": s.e2e_s, "reply_token_ids": s.token_ids})
    ok = [t for t in turns if t["ok"]]
    output_tokens = sum(t["output_tokens"] for t in ok)
    queries, hits = moved("dflash2_prefix_cache_queries_total"), moved("dflash2_prefix_cache_hits_total")
    per_step_sum = moved("dflash2_spec_decode_tokens_per_verify_step_sum")
    per_step_count = moved("dflash2_spec_decode_tokens_per_verify_step_count")
    return {
        "model": model, "num_turns_sent": len(turns), "num_ok": len(ok), "num_failed": len(turns) - len(ok),
        "num_users_cancelled_at_deadline": len(pending), "errors": sorted({t["error"] for t in turns if t["error"]})[:10],
        "turns_without_usage": sum(1 for t in ok if not t["usage_reported"]),
        "longest_prompt_tokens": max((t["prompt_tokens"] for t in turns), default=0),
        "wall_s": wall, "output_tokens": output_tokens, "output_token_throughput_per_s": output_tokens / wall,
        **turn_summary(ok),
        "turn_1": turn_summary([t for t in ok if t["turn"] == 1]),
        "later_turns": turn_summary([t for t in ok if t["turn"] > 1]),
        "per_turn": [{"turn": i, **turn_summary([t for t in ok if t["turn"] == i])} for i in range(1, args.turns + 1)],
        "e2e_s": percentiles([t["e2e_s"] for t in ok if t["e2e_s"] is not None]),
        "server": {
            "prompt_tokens": moved("dflash2_prompt_tokens_total"),
            "generation_tokens": moved("dflash2_generation_tokens_total"),
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": ratio(hits, queries),
            "prefix_cache_evictions": moved("dflash2_prefix_cache_evictions_total"),
            "verify_steps": per_step_count,
            "tokens_per_verify_step": ratio(per_step_sum, per_step_count),
            # TTFT's parts inside the engine, means over the run's requests (/metrics histograms)
            "queue_s_mean": ratio(moved("dflash2_request_queue_time_seconds_sum"),
                                  moved("dflash2_request_queue_time_seconds_count")),
            "prefill_s_mean": ratio(moved("dflash2_request_prefill_time_seconds_sum"),
                                    moved("dflash2_request_prefill_time_seconds_count")),
        },
        "turns_detail": turns,
    }


def replies_match(cache: dict, no_cache: dict) -> dict:
    """Whether both servers gave the same reply ids at each (user, turn) that both completed."""
    theirs = {(t["user"], t["turn"]): t["reply_token_ids"] for t in no_cache["turns_detail"] if t["ok"]}
    both = [(t["user"], t["turn"], t["reply_token_ids"] == theirs[t["user"], t["turn"]])
            for t in cache["turns_detail"] if t["ok"] and (t["user"], t["turn"]) in theirs]
    return {"compared": len(both), "identical": sum(same for *_, same in both),
            "first_differing": [[u, t] for u, t, same in both if not same][:10]}


def multi_turn_comparison(cache: dict, no_cache: dict) -> dict:
    """The cache's gain: without / with for costs (TTFT, prefill tokens), with / without for output tok/s."""
    def p50(summary: dict) -> float | None:
        return summary["ttft_s"]["p50"]

    def p99(summary: dict) -> float | None:
        return summary["ttft_s"]["p99"]

    return {
        "ttft_p50_later_turns_without_over_with": ratio(p50(no_cache["later_turns"]), p50(cache["later_turns"])),
        "ttft_p99_later_turns_without_over_with": ratio(p99(no_cache["later_turns"]), p99(cache["later_turns"])),
        "ttft_p50_turn_1_without_over_with": ratio(p50(no_cache["turn_1"]), p50(cache["turn_1"])),
        "ttft_p50_without_over_with": ratio(p50(no_cache), p50(cache)),
        "ttft_p50_per_turn_without_over_with": [ratio(p50(b), p50(a)) for a, b in zip(cache["per_turn"],
                                                                                      no_cache["per_turn"])],
        "prefill_tokens_without_over_with": ratio(no_cache["prefill_tokens_computed"], cache["prefill_tokens_computed"]),
        "output_tok_s_with_over_without": ratio(cache["output_token_throughput_per_s"],
                                                no_cache["output_token_throughput_per_s"]),
        "replies": replies_match(cache, no_cache),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def multi_turn_table(result: dict) -> str:
    """One server's multi-turn figures, one per line."""
    server = result["server"]
    tps = server["tokens_per_verify_step"]
    rows = [("turns ok / sent", f"{result['num_ok']} / {result['num_turns_sent']}"),
            ("wall s", f"{result['wall_s']:.1f}"),
            ("hit rate (usage)", _pct(result["hit_rate"])),
            ("hit rate (/metrics)", _pct(server["prefix_cache_hit_rate"])),
            ("prompt / cached / computed", f"{result['prompt_tokens']} / {result['cached_tokens']} / "
                                           f"{result['prefill_tokens_computed']}"),
            ("evictions", f"{server['prefix_cache_evictions']:.0f}"),
            ("output tok/s", f"{result['output_token_throughput_per_s']:.1f}"),
            ("tokens/verify step", "-" if tps is None else f"{tps:.2f}")]
    for key, label in (("ttft_s", "TTFT ms p50/p99"), ("turn_1", "TTFT ms p50/p99 turn 1"),
                       ("later_turns", "TTFT ms p50/p99 turns >= 2")):
        p = (result if key == "ttft_s" else result[key])["ttft_s"]
        rows.append((label, f"{_ms(p['p50'])} / {_ms(p['p99'])}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["| turn | turns | prompt tokens | cached | hit rate | TTFT p50 ms | TTFT p99 ms |",
              "|---|---|---|---|---|---|---|"]
    for t in result["per_turn"]:
        lines.append(f"| {t['turn']} | {t['turns']} | {t['prompt_tokens']} | {t['cached_tokens']} | "
                     f"{_pct(t['hit_rate'])} | {_ms(t['ttft_s']['p50'])} | {_ms(t['ttft_s']['p99'])} |")
    return "\n".join(lines)


def multi_turn_comparison_table(cache: dict, no_cache: dict, gain: dict) -> str:
    """The two servers side by side, and the cache's gain."""
    def row(label: str, a: str, b: str, g: float | None) -> str:
        return f"| {label} | {a} | {b} | {_x(g)} |"

    tps = [r["server"]["tokens_per_verify_step"] for r in (cache, no_cache)]
    lines = ["| multi-turn | cache on | cache off | gain |", "|---|---|---|---|",
             row("hit rate (usage)", _pct(cache["hit_rate"]), _pct(no_cache["hit_rate"]), None),
             row("hit rate (/metrics)", _pct(cache["server"]["prefix_cache_hit_rate"]),
                 _pct(no_cache["server"]["prefix_cache_hit_rate"]), None),
             row("prefill tokens computed", str(cache["prefill_tokens_computed"]),
                 str(no_cache["prefill_tokens_computed"]), gain["prefill_tokens_without_over_with"])]
    for key, label in (("turn_1", "turn 1"), ("later_turns", "turns >= 2")):
        for q in ("p50", "p99"):
            a, b = cache[key]["ttft_s"][q], no_cache[key]["ttft_s"][q]
            lines.append(row(f"TTFT {q} ms, {label}", _ms(a), _ms(b), ratio(b, a)))
    lines.append(row("TTFT p50 ms, all", _ms(cache["ttft_s"]["p50"]), _ms(no_cache["ttft_s"]["p50"]),
                     gain["ttft_p50_without_over_with"]))
    for key, label in (("queue_s_mean", "queue ms mean (engine: arrival to first prefill step)"),
                       ("prefill_s_mean", "prefill ms mean (engine: first prefill step to first token)")):
        a, b = cache["server"].get(key), no_cache["server"].get(key)
        lines.append(row(label, _ms(a), _ms(b), ratio(b, a)))
    lines.append(row("tokens/verify step", *("-" if x is None else f"{x:.2f}" for x in tps), None))
    lines.append(row("output tok/s", f"{cache['output_token_throughput_per_s']:.1f}",
                     f"{no_cache['output_token_throughput_per_s']:.1f}", gain["output_tok_s_with_over_without"]))
    replies = gain["replies"]
    lines.append(f"| replies identical | {replies['identical']} / {replies['compared']} | | |")
    lines += ["", "| turn | hit rate | TTFT p50 ms cache on | TTFT p50 ms cache off | gain |", "|---|---|---|---|---|"]
    for a, b, g in zip(cache["per_turn"], no_cache["per_turn"], gain["ttft_p50_per_turn_without_over_with"]):
        lines.append(f"| {a['turn']} | {_pct(a['hit_rate'])} | {_ms(a['ttft_s']['p50'])} | "
                     f"{_ms(b['ttft_s']['p50'])} | {_x(g)} |")
    return "\n".join(lines)


# ---- the server --------------------------------------------------------------------------------


def check_loopback(host: str) -> None:
    if host in LOOPBACK_NAMES:
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"--url host {host!r}: expected a loopback address (127.0.0.0/8, ::1 or localhost)")


class ServerProcess:
    """``ft serve <args> --host 127.0.0.1 --port 0`` in a child process, its log kept."""

    def __init__(self, serve_args: list[str], startup_timeout: float):
        command = [sys.executable, "-m", "dflash2.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port", "0"]
        self.command = command
        self.lines: list[str] = []
        listening = threading.Event()
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))

        def read() -> None:
            for line in self.proc.stderr:
                self.lines.append(line)
                sys.stderr.write(line)
                if "listening on" in line:
                    listening.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + startup_timeout
        while not listening.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"ft serve did not start (status {self.proc.poll()}):\n" + "".join(self.lines[-20:]))
        match = re.search(r"listening on http://([\d.]+):(\d+)", "".join(self.lines))
        self.host, self.port = match.group(1), int(match.group(2))
        # the startup line "serving 'name': model ..." (not "no --model: serving the bundled pair ...")
        self.summary = next((line.strip() for line in self.lines if re.search(r"serving ['\"]", line)), "")

    def stop(self, timeout: float) -> dict:
        """SIGTERM, then wait for the drain; the exit status and how long it took."""
        code, seconds = terminate(self.proc, self.reader, timeout)
        return {"exit_status": code, "shutdown_s": seconds}


def terminate(proc: subprocess.Popen, reader: threading.Thread, timeout: float) -> tuple[int, float]:
    """SIGTERM a child (unless it has exited), wait up to ``timeout`` for it (then SIGKILL), join its output
    reader; (exit status, seconds it took)."""
    start = time.perf_counter()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    reader.join(5)
    return code, time.perf_counter() - start


# ---- the command -------------------------------------------------------------------------------


def table(result: dict) -> str:
    rows = [("requests ok / sent", f"{result['num_ok']} / {result['num_requests_sent']}"),
            ("wall s", f"{result['wall_s']:.1f}"),
            ("requests/s", f"{result['request_throughput_per_s']:.2f}"),
            ("output tok/s", f"{result['output_token_throughput_per_s']:.1f}"),
            ("total tok/s", f"{result['total_token_throughput_per_s']:.1f}")]
    for key, label, scale in (("ttft_s", "TTFT ms", 1e3), ("tpot_s", "TPOT ms", 1e3), ("itl_s", "ITL ms", 1e3),
                              ("e2e_s", "E2E ms", 1e3)):
        p = result[key]
        if p["n"]:
            rows.append((f"{label} p50/p90/p99", f"{p['p50'] * scale:.1f} / {p['p90'] * scale:.1f} / "
                                                 f"{p['p99'] * scale:.1f}"))
    tps = result["server"]["tokens_per_verify_step"]
    if tps is not None:
        rows.append(("tokens/verify step", f"{tps:.2f}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


SPECULATIVE_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                     "--speculative-depth")


def plain_serve_args(serve_args: list[str]) -> list[str]:
    """The same ``ft serve`` arguments with plain decoding: every speculative flag (and its value) dropped."""
    kept, skip = [], False
    for arg in serve_args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in SPECULATIVE_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept + ["--speculative-algorithm", "none"]


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1, comma-separated")
    return levels


def load_texts(path: str) -> list[str]:
    try:
        texts = json.loads(Path(path).read_text()).get("prompts")
    except (OSError, ValueError, AttributeError) as e:
        raise SystemExit(f"--prompts {path!r}: expected a readable JSON file {{\"prompts\": [...]}} ({e})")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise SystemExit(f"--prompts {path!r}: expected {{\"prompts\": [non-empty text, ...]}}")
    return texts


def on_server(args: argparse.Namespace, url: str | None, serve_args: list[str], work) -> tuple[object, dict | None]:
    """``work(host, port)`` on one server (``url``, or ``ft serve serve_args`` started here and stopped after);
    its result and the started server's record."""
    server = None
    if url is not None:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or 80
        check_loopback(host)
        host = socket.gethostbyname(host) if host == "localhost" else host
    else:
        server = ServerProcess(serve_args, args.startup_timeout_s)
        host, port = server.host, server.port
    try:
        result = work(host, port)
    finally:
        record = None
        if server is not None:
            record = {"command": server.command, "summary": server.summary, "shutdown": server.stop(args.timeout_s)}
    return result, record


def sweep(args: argparse.Namespace, url: str | None, serve_args: list[str]) -> tuple[list[dict], dict | None]:
    """The load at each concurrency level on one server (``url``, or ``ft serve serve_args`` started here);
    the levels' results and the started server's record."""
    def levels(host: str, port: int) -> list[dict]:
        return [{"concurrency": level, **asyncio.run(run_load(argparse.Namespace(
            **{**vars(args), "concurrency": level}), host, port))} for level in args.concurrency]

    return on_server(args, url, serve_args, levels)


PREFIX_CACHE_FLAGS = ("--prefix-caching", "--no-prefix-caching")


def no_cache_serve_args(serve_args: list[str]) -> list[str]:
    """The same ``ft serve`` arguments with the prefix cache off."""
    return [arg for arg in serve_args if arg not in PREFIX_CACHE_FLAGS] + ["--no-prefix-caching"]


def multi_turn(args: argparse.Namespace, serve_args: list[str]) -> tuple[dict, int]:
    """--multi-turn: the conversations on the server under test and, asked, on one without the prefix cache;
    the result (written to --out) and the exit status. Prints the tables."""
    def work(host: str, port: int) -> dict:
        return asyncio.run(run_multi_turn(args, host, port))

    cache, server = on_server(args, args.url, serve_args, work)
    no_cache, no_cache_server, gain = None, None, None
    if args.compare_no_cache or args.no_cache_url:
        no_cache, no_cache_server = on_server(args, args.no_cache_url, no_cache_serve_args(serve_args), work)
        gain = multi_turn_comparison(cache, no_cache)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "texts", "concurrency", "num_requests",
                                                                "input_len", "prompts", "compare_plain", "plain_url")}
    result = {"workload": "multi-turn", "cache": cache, "no_cache": no_cache, "comparison": gain, "config": config,
              "serve_args": serve_args, "server": server, "no_cache_server": no_cache_server,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for label, r in (("cache on", cache), ("cache off", no_cache)):
        if r is not None:
            print(f"multi-turn, {label}: {args.users} users x {args.turns} turns, system {args.system_len} tokens, "
                  f"user {args.user_len}, reply {args.output_len}; longest prompt {r['longest_prompt_tokens']}")
            print(multi_turn_table(r))
    if gain is not None:
        print(multi_turn_comparison_table(cache, no_cache, gain))
        replies = gain["replies"]
        if replies["identical"] != replies["compared"]:
            print(f"warning: {replies['compared'] - replies['identical']} of {replies['compared']} replies differ "
                  f"between the servers (first (user, turn): {replies['first_differing']}); the histories after "
                  f"them differ too", file=sys.stderr)
    ran = [r for r in (cache, no_cache) if r is not None]
    return result, 0 if all(r["num_failed"] == 0 and r["num_ok"] > 0 for r in ran) else 1


def comparison(levels: list[dict], plain: list[dict]) -> str:
    """Per level: output tokens per second of the server under test and of plain decoding, and their ratio."""
    lines = ["| concurrency | output tok/s | plain tok/s | vs plain | tokens/verify step |", "|---|---|---|---|---|"]
    for r, base in zip(levels, plain):
        ratio = r["output_token_throughput_per_s"] / base["output_token_throughput_per_s"] \
            if base["output_token_throughput_per_s"] else float("nan")
        tps = r["server"]["tokens_per_verify_step"]
        lines.append(f"| {r['concurrency']} | {r['output_token_throughput_per_s']:.1f} | "
                     f"{base['output_token_throughput_per_s']:.1f} | {ratio:.2f}x | "
                     f"{'-' if tps is None else format(tps, '.2f')} |")
    return "\n".join(lines)


def split_serve_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's arguments, those after ``--``, passed to ``ft serve``)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv: list[str] | None = None) -> int:
    argv, serve_args = split_serve_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server on this machine (else: start ft serve with the "
                                               "arguments after --)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--concurrency", type=parse_levels, default=[16],
                   help="requests in flight at once; a comma-separated list runs each level in turn (e.g. 1,8,32,64)")
    p.add_argument("--compare-plain", action="store_true",
                   help="also run the levels on plain decoding: the ft serve arguments without their speculative "
                        "flags (or --plain-url)")
    p.add_argument("--plain-url", default=None, help="a running plain-decoding server to compare with")
    p.add_argument("--prompts", default=None, help="a JSON file {\"prompts\": [text, ...]} sent (cycled) instead of "
                                                   "random ids: real acceptance")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    p.add_argument("--max-token-id", type=int, default=500, help="prompt ids are drawn below this")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--duration-s", type=float, default=300.0, help="no request starts after this")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request; the load ends by duration + this")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here")
    mt = p.add_argument_group("multi-turn chat (--multi-turn; --output-len is the reply length)")
    mt.add_argument("--multi-turn", action="store_true",
                    help="conversations over a shared system prompt with growing histories, instead of --num-requests "
                         "uniform requests")
    mt.add_argument("--system-len", type=int, default=2000, help="system prompt tokens, shared by every user (default 2000)")
    mt.add_argument("--users", type=int, default=8, help="conversations at once, each a closed loop (default 8)")
    mt.add_argument("--turns", type=int, default=6, help="turns per user (default 6)")
    mt.add_argument("--user-len", type=int, default=128, help="new tokens per user message (default 128)")
    mt.add_argument("--stagger-s", type=float, default=0.0,
                    help="user u starts u times this many seconds in (default 0: all at once, so turn 1 of every "
                         "user is admitted before any snapshot of the system prompt exists)")
    mt.add_argument("--compare-no-cache", action="store_true",
                    help="also run the conversations with the prefix cache off: the ft serve arguments plus "
                         "--no-prefix-caching (or --no-cache-url)")
    mt.add_argument("--no-cache-url", default=None, help="a running server without the prefix cache to compare with")
    args = p.parse_args(argv)
    for name in ("num_requests", "input_len", "output_len", "max_token_id", "system_len", "users", "turns", "user_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected an integer >= 1")
    if args.stagger_s < 0:
        p.error(f"--stagger-s={args.stagger_s}: expected a number >= 0")
    if args.url is None and not serve_args:
        p.error("expected --url of a running server, or ft serve arguments after --")
    if args.multi_turn:
        if args.compare_plain or args.plain_url or args.prompts:
            p.error("--multi-turn: --compare-plain, --plain-url and --prompts do not apply (it sends token ids; "
                    "compare with --compare-no-cache)")
        if args.compare_no_cache and args.no_cache_url is None and not serve_args:
            p.error("--compare-no-cache: expected ft serve arguments after -- (or --no-cache-url of a running "
                    "server without the prefix cache)")
        result, code = multi_turn(args, serve_args)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return code
    if args.compare_no_cache or args.no_cache_url:
        p.error("--compare-no-cache and --no-cache-url go with --multi-turn")
    if args.compare_plain and args.plain_url is None and not serve_args:
        p.error("--compare-plain: expected ft serve arguments after -- (or --plain-url of a running plain server)")
    args.texts = load_texts(args.prompts) if args.prompts else None
    levels, server = sweep(args, args.url, serve_args)
    plain, plain_server = None, None
    if args.compare_plain or args.plain_url:
        plain, plain_server = sweep(args, args.plain_url, plain_serve_args(serve_args))
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "texts")}
    result = {"levels": levels, "plain_levels": plain, "config": config, "serve_args": serve_args,
              "server": server, "plain_server": plain_server, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for level in levels:
        print(f"concurrency {level['concurrency']}:")
        print(json.dumps({k: level[k] for k in ("num_ok", "num_failed", "output_token_throughput_per_s")}))
        print(table(level))
    if plain is not None:
        print(comparison(levels, plain))
    ran = levels + (plain or [])
    return 0 if all(r["num_failed"] == 0 and r["num_ok"] > 0 for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
