"""Prefix-cache affinity through a router: N ``ft serve`` replicas behind ``sglang-router``
(``scripts/serve_replicas.sh``), a multi-turn workload sent through the router once per routing policy, and
which replica served each turn, the prefix-cache hit rate and every replica's own counters.

    python bench/replicas_affinity.py --router-bin /path/to/sglang-router \\
        --out bench/results/<date>-cpu-replicas/affinity.json            # the bundled pair, 2 replicas

Everything after ``--`` is passed to every replica's ``ft serve`` (default: nothing, the bundled pair).

The workload: ``--users`` conversations of ``--turns`` turns over ``/v1/completions`` with text prompts (the
router routes by request text and refuses token-id prompts). User u's first prompt is a few of the Python
prompts of ``bench/prompts/python-8.json`` (a different first one per user, so conversations share no prefix
the router would count); turn t + 1's prompt is turn t's prompt, its reply's text and a new function header
to complete, so each turn extends the previous one, as a chat history does. Replies are greedy
(``temperature`` 0), ``--output-len`` tokens (``ignore_eos``), so the same prompts come back on every run and
under every policy. The turns go in waves: turn t of every user at once, then turn t + 1, so the router sees
``--users`` requests in flight and spreads new conversations by load.

Per policy (``--policies``, default ``cache_aware,random``) the replicas and the router start afresh (empty
prefix caches), and after each wave the script reads every replica's ``/metrics``: the requests finished,
prompt tokens and prefix-cache hits each replica gained in the wave. The users' requests of the wave are
assigned to replicas so those three sums match (every assignment is tried; a user whose replica differs
between fitting assignments stays unknown, ``null``). Reported per policy: each conversation's replica per
turn, affinity (turns after the first served by the replica that served the conversation's previous turn),
the hit rate (the sum of ``usage.prompt_tokens_details.cached_tokens`` over the sum of prompt tokens, all
turns and later turns), its ceiling (every later turn resuming after its previous turn's prompt and reply:
what perfect affinity gives), and each replica's counters over the run (requests, prompt and generation
tokens, prefix-cache queries, hits, hit rate, evictions, tokens per verify step). JSON to ``--out``, and a
table.

Standard library only beside the project (it reuses ``bench/load_serve.py``'s HTTP client); the router is not a
dependency of the project: ``pip install sglang-router`` (its own venv is best) and point ``--router-bin`` or
``$SGLANG_ROUTER`` at its ``sglang-router``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from dflash2.bench.load_serve import http, parse_metrics, split_serve_args, terminate

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "serve_replicas.sh"
PROMPTS = ROOT / "bench" / "prompts" / "python-8.json"
FINISHED = "dflash2_request_finished_total"
COUNTERS = {"requests": FINISHED, "prompt_tokens": "dflash2_prompt_tokens_total",
            "generation_tokens": "dflash2_generation_tokens_total",
            "prefix_cache_queries": "dflash2_prefix_cache_queries_total",
            "prefix_cache_hits": "dflash2_prefix_cache_hits_total",
            "prefix_cache_evictions": "dflash2_prefix_cache_evictions_total",
            "verify_steps": "dflash2_spec_decode_tokens_per_verify_step_count",
            "verify_step_tokens": "dflash2_spec_decode_tokens_per_verify_step_sum",
            "e2e_s_sum": "dflash2_e2e_request_latency_seconds_sum"}


# ---- the workload ------------------------------------------------------------------------------


def conversations(users: int, turns: int) -> tuple[list[str], list[list[str]]]:
    """Each user's first prompt and the messages of its later turns (``[user][turn - 2]``)."""
    texts = json.loads(PROMPTS.read_text())["prompts"]
    n = len(texts)
    first, later = [], []
    for u in range(users):
        head = f"# part {u // n}\n" if u >= n else ""  # past 8 users, something before the shared starts
        first.append(head + "    pass\n\n\n".join(texts[(u + i) % n] for i in range(3)))
        later.append(["\n\n\n" + texts[(u + 2 + t) % n] for t in range(1, turns)])
    return first, later


async def complete(host: str, port: int, body: dict, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        status, raw = await http(host, port, "POST", "/v1/completions", body, timeout=timeout)
    except (asyncio.TimeoutError, OSError, ValueError) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    e2e = time.perf_counter() - start
    try:
        out = json.loads(raw)
    except ValueError:
        out = {}
    if status != 200 or "choices" not in out:
        return {"ok": False, "error": f"status {status}: {raw[:200].decode(errors='replace')}"}
    usage = out["usage"]
    return {"ok": True, "text": out["choices"][0]["text"], "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "e2e_s": e2e}


async def counters(url: str) -> dict[str, float]:
    parts = urlsplit(url)
    status, raw = await http(parts.hostname, parts.port, "GET", "/metrics")
    metrics = parse_metrics(raw.decode())
    return {key: sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
            for key, name in COUNTERS.items()}


def moved(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def fitting(results: list[dict], deltas: list[dict]) -> list[tuple[int, ...]]:
    """The assignments of a wave's requests to replicas whose per-replica request count, prompt tokens and cached
    tokens equal what each replica's counters gained in the wave (every assignment is tried)."""
    n = len(deltas)
    want = [[round(d["requests"]), round(d["prompt_tokens"]), round(d["prefix_cache_hits"])] for d in deltas]
    fits = []
    for assignment in itertools.product(range(n), repeat=len(results)):
        sums = [[0, 0, 0] for _ in range(n)]
        for r, replica in zip(results, assignment):
            sums[replica][0] += 1
            sums[replica][1] += r["prompt_tokens"]
            sums[replica][2] += r["cached_tokens"]
        if sums == want:
            fits.append(assignment)
    return fits


def attribute(waves: list[list[tuple[int, ...]]], turns: list[dict]) -> dict[tuple[int, int], int | None]:
    """The replica of each (user, turn): per wave, what every fitting assignment agrees on; and, across waves,
    that a turn whose cached tokens are exactly an earlier turn's frontier (its prompt and reply less the reply's
    last token: the state that turn left in its replica's prefix cache) ran where that earlier turn ran, since
    no other replica, nor any other conversation, holds that state. Repeated until nothing changes; what is still
    open is None."""
    by = {(x["user"], x["turn"]): x for x in turns}
    same: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for (u, t), x in by.items():
        for s in range(1, t):
            earlier = by[u, s]
            if x["cached_tokens"] and x["cached_tokens"] == earlier["prompt_tokens"] + earlier["completion_tokens"] - 1:
                same.append(((u, s), (u, t)))
    known: dict[tuple[int, int], int] = {}
    fits = [list(f) for f in waves]
    while True:
        before = dict(known)
        for t, wave in enumerate(fits, start=1):
            wave[:] = [a for a in wave if all(known.get((u, t), r) == r for u, r in enumerate(a))]
            for u, replicas in enumerate(zip(*wave)):
                if len(set(replicas)) == 1:
                    known[u, t] = replicas[0]
        for a, b in same:
            if a in known and b not in known:
                known[b] = known[a]
            elif b in known and a not in known:
                known[a] = known[b]
        if known == before:
            return {key: known.get(key) for key in by}


async def run_workload(args: argparse.Namespace, router: str, replicas: list[str]) -> dict:
    parts = urlsplit(router)
    host, port = parts.hostname, parts.port
    status, raw = await http(host, port, "GET", "/v1/models")
    model = json.loads(raw)["data"][0]["id"]
    first, later = conversations(args.users, args.turns)
    prompts = list(first)
    start_counters = await asyncio.gather(*(counters(u) for u in replicas))
    turns: list[dict] = []
    waves: list[list[tuple[int, ...]]] = []
    start = time.perf_counter()
    for t in range(1, args.turns + 1):
        before = await asyncio.gather(*(counters(u) for u in replicas))
        body = {"model": model, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        results = await asyncio.gather(*(complete(host, port, {**body, "prompt": p}, args.timeout_s)
                                         for p in prompts))
        after = await asyncio.gather(*(counters(u) for u in replicas))
        failed = [r for r in results if not r["ok"]]
        if failed:
            raise SystemExit(f"turn {t}: {len(failed)} requests failed: {failed[0]['error']}")
        waves.append(fitting(results, [moved(a, b) for a, b in zip(after, before)]))
        for u, r in enumerate(results):
            turns.append({"user": u, "turn": t, "replica": None, "prompt_chars": len(prompts[u]),
                          **{k: r[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "e2e_s")},
                          "reply": r["text"]})
        if t < args.turns:
            prompts = [p + r["text"] + later[u][t - 1] for u, (p, r) in enumerate(zip(prompts, results))]
    wall = time.perf_counter() - start
    replica_of = attribute(waves, turns)
    for x in turns:
        x["replica"] = replica_of[x["user"], x["turn"]]
    ambiguous_waves = sum(len(w) != 1 for w in waves)
    end_counters = await asyncio.gather(*(counters(u) for u in replicas))
    return summarize(args, model, turns, [moved(a, b) for a, b in zip(end_counters, start_counters)], replicas, wall,
                     ambiguous_waves)


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(args, model: str, turns: list[dict], per_replica: list[dict], replicas: list[str], wall: float,
              ambiguous_waves: int) -> dict:
    by = {(x["user"], x["turn"]): x for x in turns}
    later = [x for x in turns if x["turn"] > 1]
    # perfect affinity: a later turn resumes after its previous turn's prompt and reply (its last token never
    # went through the target, so the frontier is one short)
    ceiling = sum(by[x["user"], x["turn"] - 1]["prompt_tokens"] + by[x["user"], x["turn"] - 1]["completion_tokens"]
                  - 1 for x in later)
    known = [x for x in later if x["replica"] is not None and by[x["user"], x["turn"] - 1]["replica"] is not None]
    stayed = sum(x["replica"] == by[x["user"], x["turn"] - 1]["replica"] for x in known)
    prompt = sum(x["prompt_tokens"] for x in turns)
    cached = sum(x["cached_tokens"] for x in turns)
    later_prompt = sum(x["prompt_tokens"] for x in later)
    replica_rows = []
    for url, d in zip(replicas, per_replica):
        replica_rows.append({"url": url, **{k: d[k] for k in COUNTERS if k not in ("verify_step_tokens", "e2e_s_sum")},
                             "prefix_cache_hit_rate": ratio(d["prefix_cache_hits"], d["prefix_cache_queries"]),
                             "tokens_per_verify_step": ratio(d["verify_step_tokens"], d["verify_steps"]),
                             "e2e_s_mean": ratio(d["e2e_s_sum"], d["requests"]),
                             "conversations_started": sum(1 for x in turns if x["turn"] == 1 and
                                                          x["replica"] == replicas.index(url))})
    return {
        "model": model, "wall_s": wall, "turns_sent": len(turns),
        "conversations": [{"user": u, "replicas": [by[u, t]["replica"] for t in range(1, args.turns + 1)],
                           "cached_tokens": [by[u, t]["cached_tokens"] for t in range(1, args.turns + 1)],
                           "prompt_tokens": [by[u, t]["prompt_tokens"] for t in range(1, args.turns + 1)]}
                          for u in range(args.users)],
        "affinity": {"later_turns": len(later), "attributed": len(known), "same_replica_as_previous_turn": stayed,
                     "rate": ratio(stayed, len(known)), "waves_with_ambiguous_attribution": ambiguous_waves,
                     "unattributed_turns": sum(x["replica"] is None for x in turns)},
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": ratio(cached, prompt),
        "later_turns_hit_rate": ratio(sum(x["cached_tokens"] for x in later), later_prompt),
        "ceiling_hit_rate": ratio(ceiling, prompt), "later_turns_ceiling_hit_rate": ratio(ceiling, later_prompt),
        "metrics_hit_rate": ratio(sum(d["prefix_cache_hits"] for d in per_replica),
                                  sum(d["prefix_cache_queries"] for d in per_replica)),
        "e2e_s_mean_later_turns": ratio(sum(x["e2e_s"] for x in later), len(later)),
        "replicas": replica_rows,
        "turns_detail": turns,
    }


# ---- the replicas and the router (scripts/serve_replicas.sh) -------------------------------------------


def free_block(n: int) -> int:
    """A port p with p .. p + n all free on 127.0.0.1 (checked by binding; a race with other programs remains)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SystemExit("no block of free ports found")


class Stack:
    """``scripts/serve_replicas.sh`` in a child process: its replica and router URLs, stopped by SIGTERM."""

    def __init__(self, args: argparse.Namespace, policy: str, serve_args: list[str], log_dir: Path):
        port = free_block(args.replicas + 1)
        metrics_port = free_block(0)
        self.command = [str(SCRIPT), "--replicas", str(args.replicas), "--port", str(port), "--policy", policy,
                        "--router-bin", args.router_bin, "--router-metrics-port", str(metrics_port),
                        "--log-dir", str(log_dir), "--startup-timeout", str(int(args.startup_timeout_s)),
                        "--", *serve_args]
        self.lines: list[str] = []
        ready = threading.Event()
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHON=sys.executable))

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                sys.stderr.write("  | " + line)
                if line.startswith("ready:"):
                    ready.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + args.startup_timeout_s + 60
        while not ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("serve_replicas.sh did not come up:\n" + "".join(self.lines[-20:]))
        text = "".join(self.lines)
        self.replicas = re.findall(r"^replica \d+: (\S+)", text, re.M)
        self.router = re.search(r"^router: (\S+)", text, re.M).group(1)

    def stop(self, timeout: float = 120) -> dict:
        code, seconds = terminate(self.proc, self.reader, timeout)
        return {"exit_status": code, "shutdown_s": seconds,
                "stopped_line": next((x.strip() for x in self.lines if x.startswith("stopped:")), None)}


# ---- the command -------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(results: dict[str, dict]) -> str:
    names = list(results)
    rows = [("turns (users x turns)", lambda r: str(r["turns_sent"])),
            ("affinity: later turns on the previous turn's replica",
             lambda r: f"{r['affinity']['same_replica_as_previous_turn']}/{r['affinity']['attributed']} "
                       f"({_pct(r['affinity']['rate'])})"),
            ("hit rate, all turns (usage)", lambda r: _pct(r["hit_rate"])),
            ("hit rate, later turns (usage)", lambda r: _pct(r["later_turns_hit_rate"])),
            ("  ceiling, later turns (perfect affinity)", lambda r: _pct(r["later_turns_ceiling_hit_rate"])),
            ("hit rate (replicas' /metrics)", lambda r: _pct(r["metrics_hit_rate"])),
            ("conversations started per replica",
             lambda r: " / ".join(str(x["conversations_started"]) for x in r["replicas"])),
            ("requests per replica", lambda r: " / ".join(str(round(x["requests"])) for x in r["replicas"])),
            ("hit rate per replica", lambda r: " / ".join(_pct(x["prefix_cache_hit_rate"]) for x in r["replicas"])),
            ("mean e2e s, later turns", lambda r: f"{r['e2e_s_mean_later_turns']:.2f}")]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(f(results[n]) for n in names) + " |" for label, f in rows]
    for name in names:
        lines.append(f"\n{name}: replica per turn, per conversation (cached tokens / prompt tokens)")
        for c in results[name]["conversations"]:
            cells = " ".join(f"{'?' if r is None else r}({h}/{p})"
                             for r, h, p in zip(c["replicas"], c["cached_tokens"], c["prompt_tokens"]))
            lines.append(f"  user {c['user']}: {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv, serve_args = split_serve_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--users", type=int, default=6, help="conversations, all in flight at once (default 6)")
    p.add_argument("--turns", type=int, default=5, help="turns per conversation (default 5)")
    p.add_argument("--output-len", type=int, default=48, help="reply tokens per turn (default 48)")
    p.add_argument("--policies", default="cache_aware,random",
                   help="router policies, one run each (default cache_aware,random; round_robin runs too, but\n"
                        "with a number of users per wave that the replicas divide, its rotation can keep a user\n"
                        "on one replica by arithmetic, not by prefix)")
    p.add_argument("--router-bin", default=os.environ.get("SGLANG_ROUTER") or shutil.which("sglang-router"),
                   help="the sglang-router executable (default: $SGLANG_ROUTER, else on PATH)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="replica and router logs (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    if not args.router_bin:
        p.error("no sglang-router found: pip install sglang-router (its own venv is best) and pass --router-bin")
    for name in ("replicas", "users", "turns", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1")
    if args.replicas ** args.users > 1 << 20:
        p.error("--replicas ** --users: too many assignments to try per wave (keep it under a million)")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    log_root = Path(args.log_dir) if args.log_dir else Path(os.environ.get("TMPDIR", "/tmp")) / \
        f"replicas-affinity-{os.getpid()}"
    results, stacks = {}, {}
    for policy in policies:
        print(f"policy {policy}: starting {args.replicas} replicas and the router", file=sys.stderr)
        stack = Stack(args, policy, serve_args, log_root / policy)
        try:
            results[policy] = asyncio.run(run_workload(args, stack.router, stack.replicas))
        finally:
            stacks[policy] = {"command": stack.command, "router": stack.router, "replicas": stack.replicas,
                              "shutdown": stack.stop()}
    replies = {}
    if len(results) > 1:
        base, *others = results.values()
        texts = {(x["user"], x["turn"]): x["reply"] for x in base["turns_detail"]}
        replies = {name: sum(texts[x["user"], x["turn"]] == x["reply"] for x in r["turns_detail"])
                   for name, r in zip(list(results)[1:], others)}
    version = subprocess.run([args.router_bin, "--version"], capture_output=True, text=True).stdout.strip() or None
    out = {"workload": {k: getattr(args, k) for k in ("replicas", "users", "turns", "output_len")},
           "policies": results, "stacks": stacks, "serve_args": serve_args,
           "replies_identical_to_first_policy": replies, "router_bin": args.router_bin, "router_version": version,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{args.replicas} replicas, {args.users} users x {args.turns} turns, replies of {args.output_len} tokens")
    print(table(results))
    ok = all(s["shutdown"]["exit_status"] == 0 for s in stacks.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
