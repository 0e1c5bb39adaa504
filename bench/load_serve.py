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


async def one_request(host: str, port: int, body: dict, headers: dict, timeout: float) -> Sample:
    start = time.perf_counter()
    token_times: list[tuple[float, int]] = []
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
            n = sum(len(c.get("token_ids") or ()) for c in event.get("choices", ()))
            if n:
                token_times.append((time.perf_counter(), n))

    try:
        status, raw = await asyncio.wait_for(http(host, port, "POST", "/v1/completions", body, headers=headers,
                                                  on_data=on_data, timeout=timeout), timeout)
    except (asyncio.TimeoutError, OSError, ValueError) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if status != 200 or errors:
        return Sample(False, status, errors[0] if errors else raw[:200].decode(errors="replace"))
    tokens = sum(n for _, n in token_times)
    sample = Sample(True, status, output_tokens=tokens, e2e_s=end - start)
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


async def run_load(args: argparse.Namespace, host: str, port: int) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    status, raw = await http(host, port, "GET", "/v1/models", headers=headers)
    if status != 200:
        raise SystemExit(f"GET /v1/models: status {status}: {raw[:200]!r}")
    model = json.loads(raw)["data"][0]["id"]
    rng = random.Random(args.seed)
    prompts = ([args.texts[i % len(args.texts)] for i in range(args.num_requests)] if args.texts else
               [[rng.randrange(args.max_token_id) for _ in range(args.input_len)] for _ in range(args.num_requests)])
    bodies = [{"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
               "ignore_eos": True, "stream": True, "return_token_ids": True, "seed": i}
              for i, prompt in enumerate(prompts)]
    before = parse_metrics((await http(host, port, "GET", "/metrics"))[1].decode())
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
    after = parse_metrics((await http(host, port, "GET", "/metrics"))[1].decode())

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
        self.summary = next((line.strip() for line in self.lines if "serving " in line), "")

    def stop(self, timeout: float) -> dict:
        """SIGTERM, then wait for the drain; the exit status and how long it took."""
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.reader.join(5)
        return {"exit_status": code, "shutdown_s": time.perf_counter() - start}


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


def sweep(args: argparse.Namespace, url: str | None, serve_args: list[str]) -> tuple[list[dict], dict | None]:
    """The load at each concurrency level on one server (``url``, or ``ft serve serve_args`` started here);
    the levels' results and the started server's record."""
    server = None
    if url is not None:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or 80
        check_loopback(host)
        host = socket.gethostbyname(host) if host == "localhost" else host
    else:
        server = ServerProcess(serve_args, args.startup_timeout_s)
        host, port = server.host, server.port
    results = []
    try:
        for level in args.concurrency:
            results.append({"concurrency": level, **asyncio.run(run_load(argparse.Namespace(
                **{**vars(args), "concurrency": level}), host, port))})
    finally:
        record = None
        if server is not None:
            record = {"command": server.command, "summary": server.summary, "shutdown": server.stop(args.timeout_s)}
    return results, record


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
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
    args = p.parse_args(argv)
    for name in ("num_requests", "input_len", "output_len", "max_token_id"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected an integer >= 1")
    if args.url is None and not serve_args:
        p.error("expected --url of a running server, or ft serve arguments after --")
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
