"""One captured step's kernels, in order, on the GPU: where a decode or speculative step's time goes.

    python3 scripts/diag/step_trace.py --model bench/shapes/qwen3.5-35b-a3b \
        --draft bench/shapes/qwen3.5-35b-a3b-dflash2 --setting dflash7 --prompt-len 512 --out trace.json

Builds the engine as ``ft bench`` does (dummy weights, simulated acceptance for speculative
settings), generates once so the steps are captured, then replays the step of ``--requests`` requests
(one by default; the smallest captured batch that holds them): the decode forward for ``off``, the whole
speculative step otherwise, each a few graphs (fast/model/capture.py),
and, for DFlash, a graph of the draft's propose alone, under the torch profiler. Reports per step:
the CUDA-event time of a replay, the sum of its kernels' times (the difference is the GPU's idle
gaps between kernels), the kernel count, a table by kernel name, and the first ``--list`` kernels
in launch order; ``--host-profile N`` adds a cProfile of an N-token generate and the runner's step times;
``--timeline N`` profiles an N-token generate (host and device) and splits each runner step's wall time
into the host's lead before its first kernel, the GPU's span (kernels busy, gaps) and the tail after
the last kernel, with the host calls of the lead; ``--host-split N`` times (perf_counter, no
profiler) the host's parts of each graphed step of an N-token generate: each event's offset from the
step's start (the fills, the uploads, the first and last graph launches, the device read at the end).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

from dflash2.bench.measure import capture_graph, cuda_time
from dflash2.bench.run import SETTINGS
from dflash2.bench.simulated import SimulatedAcceptance, SimulatedVerifier
from dflash2.fast.kernels.sampling.sampler import SamplingTensors
from dflash2.fast.llm import LLM
from dflash2.reference.request.sampling_params import SamplingParams


def kernels_of(fn, reps: int = 3) -> list[tuple[str, float]]:
    """(name, us) of every kernel of the last of ``reps`` calls of ``fn``, in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_call = len(kernels) // reps
    return [(e["name"], float(e["dur"])) for e in kernels[-per_call:]]


def report(label: str, fn, listed: int) -> dict:
    wall_us = 1e6 * cuda_time(fn, reps=20)
    kernels = kernels_of(fn)
    busy = sum(d for _, d in kernels)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, dur in kernels:
        by_name[name][0] += 1
        by_name[name][1] += dur
    table = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    print(f"\n== {label}: replay {wall_us:.1f} us, kernels {busy:.1f} us busy ({busy / wall_us:.0%}), "
          f"{len(kernels)} kernels, idle {wall_us - busy:.1f} us")
    for name, (calls, dur) in table[:40]:
        print(f"  {dur:9.1f} us {dur / wall_us:6.1%} {calls:5d}x  {name[:110]}")
    print(f"  -- first {listed} in order --")
    for name, dur in kernels[:listed]:
        print(f"  {dur:8.2f}  {name[:120]}")
    return {"label": label, "replay_us": wall_us, "busy_us": busy, "num_kernels": len(kernels),
            "by_name": [{"name": n, "calls": c, "us": d} for n, (c, d) in table],
            "ordered": [{"name": n, "us": d} for n, d in kernels]}


def side_stream_ab(llm, prompt: list[int], key, step_on, rounds: int) -> dict:
    """The captured step ``step_on`` (side stream on) against the same step captured with it off, replayed
    in interleaved rounds; prints and returns each variant's per-round medians (us)."""
    runner = llm.engine.runner
    runner.spec.side.stream = None  # fork then runs the observe in the step's own stream, where it forks
    runner.step_graphs.graphs.clear()
    llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    step_off = runner.step_graphs.graphs.get(key)
    if step_off is None:
        sys.exit(f"the side-stream-off capture has no graph for {key}")
    times = {"side stream on": [], "side stream off": []}
    for _ in range(rounds):
        for name, step in (("side stream on", step_on), ("side stream off", step_off)):
            times[name].append(1e6 * cuda_time(step.replay, reps=20))
    print(f"\n== side stream A/B, {rounds} interleaved rounds of 20 replays (us, median of each round)")
    for name, values in times.items():
        rounds_text = " ".join(f"{v:.1f}" for v in values)
        print(f"  {name:16s} median {sorted(values)[len(values) // 2]:8.1f}  rounds {rounds_text}")
    return {"label": "side stream A/B", "rounds_us": times}


def ahead_ab(llm, prompt: list[int], tokens: int, rounds: int) -> dict:
    """The engine's verify step with proposals launched ahead, with the proposal fields' reuse alone, and with
    neither (``StepGraphs``), in interleaved rounds of one ``tokens``-token generate each: per round, the
    median of ``runner.verify``'s wall time (what ``ft bench`` reports as the step) and the wall from the first
    verify step's start to the last one's end per step (the engine's own host time between steps too; the
    prefill before them left out). Prints and returns them (us)."""
    import time

    runner = llm.engine.runner
    graphs = runner.step_graphs
    verify, walls, spans = runner.verify, [], []

    def timed(plan, *a, **kw):
        start = time.perf_counter()
        out = verify(plan, *a, **kw)
        end = time.perf_counter()
        walls.append(end - start)
        spans.append((start, end))
        return out
    runner.verify = timed
    variants = {"ahead": (True, True), "proposal fields only": (False, True), "neither": (False, False)}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    steps = {name: [] for name in variants}
    per_step = {name: [] for name in variants}
    used = {name: 0 for name in variants}
    for _ in range(rounds):
        for name, (ahead, reuse) in variants.items():
            graphs.ahead.enabled, graphs.reuse_proposal_fields = ahead, reuse
            walls.clear()
            spans.clear()
            before = graphs.ahead.used
            llm.generate([prompt], params)
            used[name] += graphs.ahead.used - before
            steps[name].append(1e6 * sorted(walls)[len(walls) // 2])
            per_step[name].append(1e6 * (spans[-1][1] - spans[0][0]) / len(spans))
    runner.verify = verify
    graphs.ahead.enabled, graphs.reuse_proposal_fields = True, True
    print(f"\n== proposal ahead A/B, {rounds} interleaved rounds of a {tokens}-token generate (us)")
    for name in variants:
        med = sorted(steps[name])[rounds // 2]
        print(f"  {name:18s} verify step median {med:8.1f} (rounds {' '.join(f'{v:.0f}' for v in steps[name])}); "
              f"wall per step {sorted(per_step[name])[rounds // 2]:8.1f}; proposals ahead used {used[name]}")
    return {"label": "proposal ahead A/B", "step_us": steps, "wall_per_step_us": per_step, "ahead_used": used}


def host_profile(llm, prompt: list[int], tokens: int) -> None:
    """Where the host's time goes in a generate of ``tokens`` tokens (cProfile; a device wait shows as
    the time of the call that synchronises, e.g. ``tolist``), and the runner's step times."""
    import cProfile
    import pstats
    import time

    runner = llm.engine.runner
    times = collections.defaultdict(list)
    for kind in ("decode", "verify", "prefill"):
        fn = getattr(runner, kind)

        def timed(plan, *a, _fn=fn, _kind=kind, **kw):
            start = time.perf_counter()
            out = _fn(plan, *a, **kw)
            times[_kind].append(time.perf_counter() - start)
            return out
        setattr(runner, kind, timed)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)
    times.clear()
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate([prompt], params)
    profiler.disable()
    for kind, values in times.items():
        values = sorted(values)
        print(f"host: {kind} x{len(values)} median {1e3 * values[len(values) // 2]:.3f} ms")
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)


def timeline(llm, prompt: list[int], tokens: int, kind: str) -> None:
    """Each ``kind`` step of an N-token generate on one timeline (torch profiler, host and device):
    lead = step start -> its first kernel (host work and launch latency the GPU waits for), span =
    first kernel start -> last kernel end (busy = kernel time within it), tail = last kernel end ->
    step end (the device read). Medians over the steps, and the host calls inside the leads."""
    from torch.profiler import ProfilerActivity, profile, record_function

    runner = llm.engine.runner
    fn = getattr(runner, kind)

    def marked(plan, *a, **kw):
        with record_function("dflash2.step"):
            return fn(plan, *a, **kw)
    setattr(runner, kind, marked)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params)
    setattr(runner, kind, fn)
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"] == "dflash2.step" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    host_calls = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function")]
    rows, lead_calls = [], collections.defaultdict(float)
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = [k for k in kernels if start <= k["ts"] and k["ts"] + k["dur"] <= end + 50]
        if not inside:
            continue
        first, last = inside[0]["ts"], max(k["ts"] + k["dur"] for k in inside)
        rows.append((step["dur"], first - start, last - first, sum(k["dur"] for k in inside), end - last, len(inside)))
        for call in host_calls:
            if start <= call["ts"] < first:
                lead_calls[call["name"]] += call["dur"] / len(steps)
    if not rows:
        print(f"timeline: no {kind} step with kernels")
        return
    med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
    print(f"\n== timeline of {len(rows)} {kind} steps (median us): wall {med[0]:.0f}, lead {med[1]:.0f}, "
          f"GPU span {med[2]:.0f} (kernels busy {med[3]:.0f}, {med[5]} kernels), tail {med[4]:.0f}")
    print("  host calls in the lead (mean us a step; nested calls count in their parents too):")
    for name, us in sorted(lead_calls.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {us:9.1f}  {name[:110]}")


def host_split(llm, prompt: list[int], tokens: int, kind: str) -> None:
    """Where a graphed step's host time goes, without a profiler's overhead: perf_counter marks around
    ``fill_batch``, ``StaticInputs.upload`` and each graph's ``replay`` of ``kind`` steps; medians."""
    import time

    from dflash2.fast.engine import graphs as graphs_module

    runner = llm.engine.runner
    marks: list[tuple[str, float]] = []
    patched = []

    def patch(owner, name, wrapper):
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper(getattr(owner, name)))

    def around(label):
        def wrapper(fn):
            def call(*a, **kw):
                marks.append((label + " start", time.perf_counter()))
                out = fn(*a, **kw)
                marks.append((label + " end", time.perf_counter()))
                return out
            return call
        return wrapper

    eager_replay = graphs_module.CapturedStep.replay

    def replay(self, start=None, stop=None):
        if not self.graphs:  # a CPU run: the step function itself, marked as one launch
            out = eager_replay(self)
            marks.append(("launch 0", time.perf_counter()))
            return out
        first = self.marks[start] if start else 0
        for i, graph in enumerate(self.graphs[first:self.marks[stop] if stop else None], start=first):
            graph.replay()
            marks.append((f"launch {i}", time.perf_counter()))
        return self.out

    patch(graphs_module, "fill_batch", around("fill_batch"))
    patch(graphs_module, "fill_per_request", around("fill_per_request"))
    patch(graphs_module.StaticInputs, "upload", around("upload"))
    patch(graphs_module.CapturedStep, "replay", lambda _: replay)
    patch(runner, kind, around("step"))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)
    marks.clear()
    llm.generate([prompt], params)
    for owner, name, fn in reversed(patched):
        setattr(owner, name, fn)
    # per step, its events in order as offsets from the step's start; steps of one kind share the order
    sequences: dict[tuple[str, ...], list[list[float]]] = collections.defaultdict(list)
    events: list[tuple[str, float]] = []
    for label, t in marks:
        events.append((label, t))
        if label != "step end":
            continue
        if events[0][0] == "step start" and any(name.startswith("launch") for name, _ in events):
            t0 = events[0][1]
            sequences[tuple(name for name, _ in events)].append([1e6 * (t - t0) for _, t in events])
        events = []
    for order, steps in sequences.items():
        print(f"\n== host split of {len(steps)} graphed {kind} steps: each event's median offset from the "
              f"step's start (us)")
        medians = [sorted(column)[len(column) // 2] for column in zip(*steps)]
        launches = [m for name, m in zip(order, medians) if name.startswith("launch")]
        for name, m in zip(order, medians):
            if not name.startswith("launch") or m in (launches[0], launches[-1]):
                print(f"  {m:9.1f}  {name}")
        print(f"  the GPU's first graph was launched {launches[0]:.1f} us into the step; wall {medians[-1]:.1f} us")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--setting", default="off", choices=sorted(SETTINGS))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=1, help="requests in the batch whose step is traced")
    p.add_argument("--tokens-per-step", type=float, default=5.4)
    p.add_argument("--list", type=int, default=120, help="kernels to print in launch order")
    p.add_argument("--out", default=None)
    p.add_argument("--host-profile", type=int, default=0, help="also cProfile a generate of this many tokens")
    p.add_argument("--timeline", type=int, default=0, help="also split the steps of a generate of this many tokens")
    p.add_argument("--host-split", type=int, default=0, help="also time the host's parts of such steps")
    p.add_argument("--ab-ahead", type=int, default=0, help="also time the engine's verify step with proposals "
                   "ahead, proposal fields only and neither, in this many interleaved rounds")
    p.add_argument("--ab-tokens", type=int, default=128, help="tokens per round of --ab-ahead")
    p.add_argument("--ab-side-stream", type=int, default=0, help="also time the step with the side stream off, "
                   "in this many interleaved rounds")
    args = p.parse_args()
    algorithm, k = SETTINGS[args.setting]
    llm = LLM(args.model, max_running_req=args.requests, load_format="dummy", seed=0, speculative_algorithm=algorithm,
              speculative_num_steps=k, speculative_draft_model_path=args.draft if algorithm == "dflash" else None,
              max_model_len=args.prompt_len + max(128, args.ab_tokens) + 64)
    runner = llm.engine.runner
    if algorithm != "none":  # each verify step keeps the simulated count of drafts (bench/simulated.py)
        simulated = SimulatedVerifier(runner.spec.verifier, SimulatedAcceptance(args.tokens_per_step), runner.device)
        runner.spec.verifier = simulated
        verify = runner.verify
        runner.verify = lambda plan, *a, **kw: simulated.next_step() or verify(plan, *a, **kw)
    vocab = llm.engine.model.target_cfg.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([prompt] * args.requests, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    results = []
    graphs = runner.step_graphs if algorithm != "none" else runner.graphs
    sizes = [key.num_seqs for key in graphs.graphs if key.num_seqs >= args.requests]
    steps = [(key, step) for key, step in graphs.graphs.items() if sizes and key.num_seqs == min(sizes)]
    if not steps:
        sys.exit(f"no graph of {args.requests} requests captured; keys: {list(graphs.graphs)}")
    key, step = max(steps, key=lambda item: item[0].rows_per_seq)  # k + 1 rows: the steady state
    results.append(report(f"{args.setting} step {key} ({len(step.graphs)} graphs)", step.replay, args.list))
    if algorithm == "dflash":
        device = runner.device
        n = args.requests
        tokens = torch.ones(n, dtype=torch.long, device=device)
        anchors = torch.full((n,), args.prompt_len, dtype=torch.long, device=device)
        slots = torch.arange(n, dtype=torch.long, device=device)
        tables = torch.zeros(n, 64, dtype=torch.int32, device=device)
        st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * n, device=device)
        graph = capture_graph(lambda: runner.spec.proposer.propose(tokens, anchors, slots, tables, k, st))
        results.append(report("draft propose (graph)", graph.replay, args.list))
    if args.host_profile:
        host_profile(llm, prompt, args.host_profile)
    if args.timeline:
        timeline(llm, prompt, args.timeline, "decode" if algorithm == "none" else "verify")
    if args.host_split:
        host_split(llm, prompt, args.host_split, "decode" if algorithm == "none" else "verify")
    if args.ab_ahead and algorithm == "dflash":
        results.append(ahead_ab(llm, prompt, args.ab_tokens, args.ab_ahead))
    if args.ab_side_stream and algorithm != "none":  # last: it leaves the side stream off
        results.append(side_stream_ab(llm, prompt, key, step, args.ab_side_stream))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
