"""Where a prefill's time goes: a cold prompt, and a chat turn that resumes from the prefix cache.

    python3 scripts/diag/prefill_trace.py --model bench/shapes/qwen3.5-35b-a3b \
        --draft bench/shapes/qwen3.5-35b-a3b-dflash2 --setting dflash7 --cold 4096 --turn-requests 1,8

Builds the engine as ``ft serve`` would (dummy weights, the prefix cache on, a fixed depth), then:

- **cold**: a fresh ``--cold``-token prompt (no hit) with ``max_tokens=1``, three times: the wall time of
  the generate (the prefill and its first token), then once under the torch profiler: the GPU's busy
  time against the wall, and the kernels by total time (issue 34: the 35B-A3B's 4,096-token prefill).
- **turn**: for each n in ``--turn-requests``, n conversations at once: turn 1 (``--system`` shared
  tokens + ``--message`` own tokens, ``--reply`` tokens out) finishes, so each conversation's
  history is snapshotted; then turn 2 (the history + a new message, ``max_tokens=1``) resumes from
  it. Reported for turn 2: tokens restored and computed, the wall of the generate, and inside it
  the restore (``Engine._restore``: pages, GDN state, window, ring rebuild) and the prefill forward
  (``runner.prefill``), each timed between device synchronisations; then one more round of turn 2
  under the profiler (issue 33: where a cached turn's time to first token goes). ``--host-profile``
  adds a cProfile of one more turn 2 of the first count: the host's calls by own time and by
  cumulative time (a call that waits on the device, e.g. ``tolist``, holds the wait). ``--server-warm-up``
  warms up as ``ft serve`` does instead of with one short request, so each part's first timed run shows
  whether a kernel still compiles on first use after it (a first run far slower than the next).

Every figure is a wall time on the device that ran it; nothing is compared across runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import torch

from dflash2.bench.run import SETTINGS
from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.llm import LLM
from dflash2.reference.request.sampling_params import SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Stopwatch:
    """Wall time (between device synchronisations) of named calls, patched onto their owners."""

    def __init__(self):
        self.times: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            sync()
            start = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            self.times[label].append(time.perf_counter() - start)
            return out
        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        """Each label's total ms since the last take."""
        out = {label: 1e3 * sum(values) for label, values in self.times.items()}
        self.times.clear()
        return out


def kernel_table(fn, top: int) -> dict:
    """One call of ``fn`` under the torch profiler: wall, the kernels' busy time, the top kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync()
    wall_us = 1e6 * (time.perf_counter() - start)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += float(e["dur"])
    busy = sum(d for _, d in by_name.values())
    table = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    print(f"  profiled: wall {wall_us / 1e3:.1f} ms (with the profiler), kernels busy {busy / 1e3:.1f} ms, "
          f"{len(kernels)} launches")
    for name, (calls, dur) in table[:top]:
        print(f"  {dur / 1e3:9.2f} ms {dur / max(busy, 1):6.1%} {calls:6d}x  {name[:110]}")
    return {"wall_us": wall_us, "busy_us": busy, "launches": len(kernels),
            "by_name": [{"name": n, "calls": c, "us": d} for n, (c, d) in table[:top]]}


def host_profile(llm, system: list[int], n: int, args) -> None:
    """cProfile of one turn 2 of ``n`` conversations (turn 1 run first, unprofiled)."""
    import cProfile
    import pstats

    vocab = llm.engine.model.target_cfg.vocab_size
    rng = torch.Generator().manual_seed(1)
    firsts = [system + torch.randint(0, vocab, (args.message,), generator=rng).tolist() for _ in range(n)]
    outs = llm.generate(firsts, greedy(args.reply))
    seconds = [f + list(o.token_ids) + torch.randint(0, vocab, (args.message,), generator=rng).tolist()
               for f, o in zip(firsts, outs)]
    sync()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(seconds, greedy(1))
    sync()
    profiler.disable()
    print(f"\n== host profile of turn 2 of {n} conversation(s): wall {1e3 * (time.perf_counter() - start):.1f} ms")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--setting", default="off", choices=sorted(SETTINGS))
    p.add_argument("--cold", type=int, default=4096, help="tokens of the cold prompt (0: skip)")
    p.add_argument("--turn-requests", default="1,8", help="conversations at once in the turn part ('' to skip)")
    p.add_argument("--system", type=int, default=2000)
    p.add_argument("--message", type=int, default=128)
    p.add_argument("--reply", type=int, default=128)
    p.add_argument("--top", type=int, default=25, help="kernels to list")
    p.add_argument("--host-profile", action="store_true", help="also cProfile a turn 2 (the host's calls)")
    p.add_argument("--server-warm-up", action="store_true",
                   help="warm up as ft serve does (fast/engine/warmup.py) instead of with one short request: the "
                        "first timed run of each part then shows what the server's warm-up leaves to compile")
    p.add_argument("--prefill-graph-rows", type=int, default=EngineConfig.prefill_graph_rows,
                   help="the engine's prefill_graph_rows (0: every prefill step eager, for an A/B)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    algorithm, k = SETTINGS[args.setting]
    turns = [int(n) for n in args.turn_requests.split(",") if n]
    llm = LLM(args.model, max_running_req=max(turns + [1]), load_format="dummy", seed=0,
              speculative_algorithm=algorithm, speculative_num_steps=k, speculative_depth="fixed",
              speculative_draft_model_path=args.draft if algorithm == "dflash" else None,
              prefill_graph_rows=args.prefill_graph_rows,
              max_model_len=max(args.cold, args.system + 2 * (args.message + args.reply)) + 64)
    engine = llm.engine
    vocab = engine.model.target_cfg.vocab_size
    rng = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    watch = Stopwatch()
    watch.wrap(engine, "_restore", "restore")
    watch.wrap(engine.runner, "prefill", "prefill forward")
    if args.server_warm_up:
        from dflash2.fast.engine.warmup import warm_up

        print(f"server warm-up: {warm_up(engine)}")
    else:
        llm.generate([tokens(600)], greedy(16))  # warm-up: graphs, kernels' first compiles
    watch.take()  # the warm-up's own restores and prefills are not the cold prompt's
    results: dict = {"model": args.model, "setting": args.setting, "device": torch.cuda.get_device_name()
                     if torch.cuda.is_available() else "cpu"}
    if args.cold:
        walls = []
        for _ in range(3):
            prompt = tokens(args.cold)
            sync()
            start = time.perf_counter()
            llm.generate([prompt], greedy(1))
            sync()
            walls.append(time.perf_counter() - start)
        parts = watch.take()
        best = min(walls)
        print(f"\n== cold prefill of {args.cold} tokens: wall {' '.join(f'{1e3 * w:.1f}' for w in walls)} ms "
              f"(best {args.cold / best:,.0f} tokens/s); over the 3: "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in parts.items()))
        prompt = tokens(args.cold)
        results["cold"] = {"tokens": args.cold, "walls_s": walls, "parts_ms": parts,
                           "profile": kernel_table(lambda: llm.generate([prompt], greedy(1)), args.top)}
        watch.take()
    system = tokens(args.system)
    results["turns"] = []
    for n in turns:
        rows = []
        for round_ in range(3):  # the last round under the profiler
            firsts = [system + tokens(args.message) for _ in range(n)]
            outs = llm.generate(firsts, greedy(args.reply))
            seconds = [f + list(o.token_ids) + tokens(args.message) for f, o in zip(firsts, outs)]
            watch.take()
            if round_ == 2:
                print(f"\n== turn 2 of {n} conversation(s), profiled:")
                profile = kernel_table(lambda: llm.generate(seconds, greedy(1)), args.top)
                watch.take()
                continue
            sync()
            start = time.perf_counter()
            outs = llm.generate(seconds, greedy(1))
            sync()
            wall = time.perf_counter() - start
            cached = [o.cached_tokens for o in outs]
            rows.append({"wall_ms": 1e3 * wall, "cached": cached, "prompt": [len(s) for s in seconds],
                         **watch.take()})
        for row in rows:
            print(f"== turn 2 of {n} conversation(s): prompt {row['prompt'][0]} tokens, restored {row['cached']}, "
                  f"wall {row['wall_ms']:.1f} ms, restore {row.get('restore', 0):.1f} ms, "
                  f"prefill forward {row.get('prefill forward', 0):.1f} ms")
        results["turns"].append({"conversations": n, "rounds": rows, "profile": profile})
        if args.host_profile and n == turns[0]:
            host_profile(llm, system, n, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
