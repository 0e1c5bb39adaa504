"""Routed-experts benchmark: the Triton MoE kernels (fast/kernels/moe/moe.py) against the torch form
(fast/kernels/moe/moe.moe_experts_torch) at Qwen3.5-35B-A3B's shapes, beside the floor.

    C = 2048, I = 512, E = 256, k = 8, bf16; N in {1, 4, 8, 16, 32, 64, 128} rows (+ 256, the dispatch limit)
    floor = distinct experts chosen x (2I C + C I) x 2 bytes / bandwidth  (6 MiB per expert; N = 1: 48 MiB)

Each timed call runs LAYERS layers, each with its own weights and routing (a softmax over random
logits, top-k, renormalised), so the weights come from HBM as in a real step and one graph launch
is spread over several layers; times are per layer. do_bench (median; it flushes L2 between
repetitions) times the eager Triton call, the torch form (one host sync per layer), and a CUDA
graph of the Triton calls (captured, then replayed: proof that the op is capturable). Checks:
Triton vs the torch form within bf16 NUMERIC (2e-2 rms-relative), two eager runs bitwise equal,
graph replay bitwise equal to eager. A short sweep of block sizes at N in {1, 4, 8, 16, 128} and a
per-kernel profile follow. Bandwidth: the nominal 4.25e12 B/s and a device-to-device copy measured here.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_moe.py --out result.json     # from the repo root

``--sweep-only N,..`` runs the sweep alone; ``--pdl-ab N,..`` PDL off / on and ``--blocks-ab N`` the default blocks
against ``BLOCKS_AB[N]``'s candidates, each in interleaved rounds of CUDA-graph replays.

``--prefill N,..`` (alone; e.g. 256,512,2048,4096) times prefill chunks instead: the grouped GEMM
(fast/kernels/moe/moe_grouped.py, the op's form past MAX_TRITON_PAIRS pairs) as CUDA-graph replays of PREFILL_LAYERS
layers, beside the torch form and, up to PER_PAIR_MAX_ROWS rows, the per-pair kernels (where the two cross); its
floor is the larger of the FLOPs ``2 P (2 I C + C I)`` over a bf16 matmul rate measured here (cuBLAS, 8192^3)
and the chosen experts' weight bytes over the nominal bandwidth. Same checks as above.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch
import torch.profiler
import triton
from triton.testing import do_bench

from dflash2.fast.kernels.moe.moe import MAX_TRITON_PAIRS, MoEBlocks, default_blocks, moe_experts_triton
from dflash2.fast.kernels.moe.moe import moe_experts_torch
from dflash2.fast.kernels.moe.moe_grouped import GroupedBlocks, moe_experts_grouped
from dflash2.fast.kernels.common.pdl import launch_settings
from dflash2.bench.measure import copy_bandwidth, matmul_rate, rms_rel

HIDDEN, WIDTH, EXPERTS, TOP_K = 2048, 512, 256, 8
ROWS = (1, 4, 8, 16, 32, 64, 128, 256)
LAYERS = 8
NOMINAL_BW = 4.25e12
EXPERT_BYTES = (2 * WIDTH * HIDDEN + HIDDEN * WIDTH) * 2
SPLIT = dict(split=True)  # the split form (fast/kernels/moe/moe.py): gate/up -> h, then the down projection by C tile
SWEEP = {  # beside each N's default (fast/kernels/moe/moe.default_blocks); one compile each
    1: [MoEBlocks(block_c=256, num_stages=4, sum_block_c=16), MoEBlocks(block_c=256, num_stages=4, sum_block_c=32),
        MoEBlocks(block_c=256, num_stages=4, sum_block_c=128), MoEBlocks(block_i=16, block_c=64, **SPLIT),
        MoEBlocks(block_i=16, block_c=64, num_stages=4, **SPLIT), MoEBlocks(block_i=32, block_c=128, **SPLIT),
        MoEBlocks(block_i=16, block_c=32, block_d=256, **SPLIT)],
    4: [MoEBlocks(block_i=64), MoEBlocks(block_i=32, block_c=128, **SPLIT), MoEBlocks(block_i=16, block_c=64, **SPLIT)],
    8: [MoEBlocks(block_i=32, block_c=64, sum_block_c=16, **SPLIT),
        MoEBlocks(block_i=32, block_c=64, sum_block_c=32, **SPLIT),
        MoEBlocks(block_i=64, num_stages=4), MoEBlocks(block_i=32, block_c=128, **SPLIT),
        MoEBlocks(block_i=32, block_c=128, num_stages=4, **SPLIT), MoEBlocks(block_i=16, block_c=64, **SPLIT),
        MoEBlocks(block_i=64, block_c=128, **SPLIT), MoEBlocks(block_i=32, block_c=64, **SPLIT),
        MoEBlocks(block_i=32, block_c=256, **SPLIT), MoEBlocks(block_i=32, block_c=64, num_stages=4, **SPLIT),
        MoEBlocks(block_i=32, block_c=64, block_k=256, **SPLIT), MoEBlocks(block_i=32, block_c=64, num_warps=8, **SPLIT),
        MoEBlocks(block_i=32, block_c=64, block_d=256, **SPLIT), MoEBlocks(block_i=32, block_c=64, block_d=64, **SPLIT),
        MoEBlocks(block_i=32, block_c=32, **SPLIT), MoEBlocks(block_i=16, block_c=64, block_k=256, **SPLIT),
        MoEBlocks(block_i=32, block_c=64, num_stages=2, **SPLIT), MoEBlocks(block_i=64, block_c=64, **SPLIT),
        MoEBlocks(block_i=32, block_c=64, block_k=256, num_warps=8, **SPLIT)],
    16: [MoEBlocks(block_i=64), MoEBlocks(block_i=32, block_c=128, **SPLIT),
         MoEBlocks(block_i=64, block_c=128, **SPLIT)],
    128: [MoEBlocks(block_i=64), MoEBlocks(block_i=64, block_c=128, **SPLIT),
          MoEBlocks(block_i=128, block_c=128, **SPLIT)],
}


def make_layers(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = []
    for _ in range(LAYERS):
        gate_up = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        down = torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)
        layers.append((gate_up.mul_(HIDDEN ** -0.5), down.mul_(WIDTH ** -0.5)))
    return layers


def make_inputs(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    probs = torch.softmax(torch.randn(rows, EXPERTS, device="cuda", generator=gen) * 2, dim=-1)
    top_probs, expert_ids = torch.topk(probs, TOP_K, dim=-1)
    return x, expert_ids, top_probs / top_probs.sum(dim=-1, keepdim=True)


def routed_case(rows: int, layers, gen: torch.Generator) -> tuple[list[tuple], float, float]:
    """Every layer's call arguments at ``rows`` rows (its own routing over its own weights), the distinct experts
    a layer chose on average, and the floor of their bytes at the nominal bandwidth (us a layer)."""
    inputs = [make_inputs(rows, gen) for _ in layers]
    args = [(x, ids, w, gu, dn) for (x, ids, w), (gu, dn) in zip(inputs, layers)]
    distinct = sum(int(torch.unique(ids).numel()) for _, ids, _ in inputs) / len(layers)
    return args, distinct, distinct * EXPERT_BYTES / NOMINAL_BW * 1e6


def capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm up on a side stream, as torch's capture recipe asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_rows(rows: int, layers, gen: torch.Generator, bandwidth: float) -> dict:
    args, distinct, floor_us = routed_case(rows, layers, gen)
    eager = [moe_experts_triton(*a) for a in args]
    again = [moe_experts_triton(*a) for a in args]
    reference = [moe_experts_torch(*a) for a in args]
    errors = [rms_rel(y, r) for y, r in zip(eager, reference)]
    outs: list[torch.Tensor] = []  # the captured calls' outputs, rewritten by every replay

    def step() -> None:
        outs[:] = [moe_experts_triton(*a) for a in args]

    graph = capture(step)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    def per_layer(fn, rep=60) -> float:
        return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3 / len(layers)

    graph_us = per_layer(graph.replay)
    triton_us = per_layer(lambda: [moe_experts_triton(*a) for a in args])
    torch_us = per_layer(lambda: [moe_experts_torch(*a) for a in args], rep=40)
    return {"rows": rows, "pairs": rows * TOP_K, "distinct_experts": distinct, "floor_us": floor_us,
            "floor_measured_bw_us": distinct * EXPERT_BYTES / bandwidth * 1e6, "graph_us": graph_us,
            "triton_eager_us": triton_us, "torch_us": torch_us, "fraction_of_floor": floor_us / graph_us,
            "speedup_vs_torch": torch_us / graph_us, "rms_rel_vs_torch": max(errors),
            "numeric_ok": max(errors) <= 2e-2,
            "runs_bitwise_equal": all(torch.equal(a, b) for a, b in zip(eager, again)),
            "graph_bitwise_equal": all(torch.equal(a, b) for a, b in zip(outs, eager)),
            "blocks": asdict(default_blocks(rows)),
            "model_dispatch_eager": "per-pair" if rows * TOP_K <= MAX_TRITON_PAIRS else "grouped"}


PREFILL_LAYERS = 4  # layers a replay runs at prefill sizes (each call is hundreds of us: fewer layers suffice)
PER_PAIR_MAX_ROWS = 512  # past it the per-pair kernels' P^2 id scans take too long to time


def bench_prefill(rows: int, layers, gen: torch.Generator, rate: float) -> dict:
    """A prefill chunk of ``rows`` rows: the grouped GEMM's graph replays against its floor (module docstring), the
    torch form and, up to PER_PAIR_MAX_ROWS rows, the per-pair kernels; us per layer."""
    layers = layers[:PREFILL_LAYERS]
    args, distinct, bytes_floor_us = routed_case(rows, layers, gen)
    flops = 2 * rows * TOP_K * (2 * WIDTH * HIDDEN + HIDDEN * WIDTH)
    flops_floor_us = flops / rate * 1e6
    floor_us = max(flops_floor_us, bytes_floor_us)
    eager = [moe_experts_grouped(*a) for a in args]
    again = [moe_experts_grouped(*a) for a in args]
    reference = [moe_experts_torch(*a) for a in args]
    errors = [rms_rel(y, r) for y, r in zip(eager, reference)]
    outs: list[torch.Tensor] = []

    def step() -> None:
        outs[:] = [moe_experts_grouped(*a) for a in args]

    graph = capture(step)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    def per_layer(fn, rep=100) -> float:
        return do_bench(fn, warmup=5, rep=rep, return_mode="median") * 1e3 / len(layers)

    graph_us = per_layer(graph.replay)
    torch_us = per_layer(lambda: [moe_experts_torch(*a) for a in args])
    result = {"rows": rows, "pairs": rows * TOP_K, "distinct_experts": distinct, "flops": flops,
              "flops_floor_us": flops_floor_us, "bytes_floor_us": bytes_floor_us, "floor_us": floor_us,
              "graph_us": graph_us, "torch_us": torch_us, "fraction_of_floor": floor_us / graph_us,
              "tflops": flops / graph_us / 1e6, "speedup_vs_torch": torch_us / graph_us,
              "rms_rel_vs_torch": max(errors), "numeric_ok": max(errors) <= 2e-2,
              "runs_bitwise_equal": all(torch.equal(a, b) for a, b in zip(eager, again)),
              "graph_bitwise_equal": all(torch.equal(a, b) for a, b in zip(outs, eager)),
              "blocks": asdict(GroupedBlocks()),
              "model_dispatch": "grouped" if rows * TOP_K > MAX_TRITON_PAIRS else "per-pair"}
    if rows <= PER_PAIR_MAX_ROWS:
        per_pair = capture(lambda: [moe_experts_triton(*a) for a in args])
        result["per_pair_graph_us"] = per_layer(per_pair.replay)
    return result


def sweep(layers, gen: torch.Generator, only_rows: set[int] | None = None) -> list[dict]:
    results = []
    for rows, configs in SWEEP.items():
        if only_rows is not None and rows not in only_rows:
            continue
        args, _, floor_us = routed_case(rows, layers, gen)
        reference = moe_experts_torch(*args[0])
        for blocks in [default_blocks(rows), *configs]:
            error = rms_rel(moe_experts_triton(*args[0], blocks=blocks), reference)
            graph = capture(lambda: [moe_experts_triton(*a, blocks=blocks) for a in args])
            us = do_bench(graph.replay, warmup=10, rep=40, return_mode="median") * 1e3 / len(layers)
            results.append({"rows": rows, "blocks": asdict(blocks), "graph_us": us, "fraction_of_floor": floor_us / us,
                            "rms_rel_vs_torch": error, "numeric_ok": error <= 2e-2})
    return results


def pdl_ab(layers, gen: torch.Generator, rows_list: list[int], rounds: int = 5) -> list[dict]:
    """PDL off / on at each row count's default blocks: one graph a variant (captured with the launch setting
    it asks for), replayed in interleaved rounds (A B, A B, ...) so drift in the machine lands on both alike; the
    median of the rounds' medians, and whether the variants' outputs are bitwise equal."""
    results = []
    for rows in rows_list:
        args, _, floor_us = routed_case(rows, layers, gen)
        variants = {"pdl off": False, "pdl on": True}
        graphs, outs = {}, {}
        for name, setting in variants.items():
            with launch_settings(pdl=setting):
                blocks = default_blocks(rows)
                captured: list[torch.Tensor] = []
                graphs[name] = capture(lambda b=blocks, c=captured: c.__setitem__(
                    slice(None), [moe_experts_triton(*a, blocks=b) for a in args]))
                graphs[name].replay()
                torch.cuda.synchronize()
                outs[name] = [t.clone() for t in captured]
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, graph in graphs.items():
                times[name].append(do_bench(graph.replay, warmup=10, rep=40, return_mode="median") * 1e3 / len(layers))
        first = outs["pdl off"]
        for name in variants:
            us = sorted(times[name])[len(times[name]) // 2]
            results.append({"rows": rows, "variant": name, "graph_us": us, "rounds_us": times[name],
                            "fraction_of_floor": floor_us / us, "floor_us": floor_us,
                            "bitwise_equal_to_pdl_off": all(torch.equal(a, b) for a, b in zip(outs[name], first))})
    return results


BLOCKS_AB = {  # rows -> the candidates --blocks-ab sets beside default_blocks(rows), from a sweep that favoured them
    1: [MoEBlocks(block_i=16, block_c=64, num_stages=4, **SPLIT)],  # perf12 call 5: 20.7 against 22.3 us a layer
    # the defaults from 8 to 16 rows are the overlapped split form (fast/kernels/moe/moe.py); against it, the plain split
    # form it replaced (perf14 calls 3 and 4, bench/results/2026-12-04-h200-perf14, held the other candidates)
    8: [MoEBlocks(block_i=32, block_c=64, **SPLIT)],
    16: [MoEBlocks(block_i=64, block_c=128, **SPLIT)],
}


def blocks_ab(layers, gen: torch.Generator, rows: int, rounds: int = 7) -> list[dict]:
    """The default blocks against each of :data:`BLOCKS_AB`'s candidates at one row count: one graph a variant,
    replayed in interleaved rounds (A B, A B, ...) so drift in the machine lands on all alike; the median of the
    rounds' medians, and each variant's error against the torch form (the forms round differently, within NUMERIC)."""
    args, _, floor_us = routed_case(rows, layers, gen)
    reference = moe_experts_torch(*args[0])
    variants = [default_blocks(rows), *BLOCKS_AB[rows]]
    ready = torch.zeros(EXPERTS, dtype=torch.int32, device="cuda")  # the overlapped form's counters, as the model's
    graphs = [capture(lambda b=b: [moe_experts_triton(*a, blocks=b, ready=ready) for a in args]) for b in variants]
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            times[i].append(do_bench(graph.replay, warmup=10, rep=40, return_mode="median") * 1e3 / len(layers))
    results = []
    for i, blocks in enumerate(variants):
        us = sorted(times[i])[len(times[i]) // 2]
        error = rms_rel(moe_experts_triton(*args[0], blocks=blocks, ready=ready), reference)
        results.append({"rows": rows, "variant": "default" if i == 0 else f"candidate {i}", "blocks": asdict(blocks),
                        "graph_us": us, "rounds_us": times[i], "fraction_of_floor": floor_us / us,
                        "rms_rel_vs_torch": error, "numeric_ok": error <= 2e-2})
    return results


def profile(layers, gen: torch.Generator) -> list[dict]:
    """GPU time per kernel (CUPTI, eager calls): what each of the two kernels costs."""
    rows_out = []
    for rows in (1, 8, 16, 128):
        args = [(*make_inputs(rows, gen), gu, dn) for gu, dn in layers]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for a in args:
                moe_experts_triton(*a)
            torch.cuda.synchronize()
        for event in prof.key_averages():
            if "_moe_" in event.key:
                us = event.device_time_total / len(args)
                rows_out.append({"rows": rows, "kernel": event.key, "us_per_layer": us})
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--no-sweep", action="store_true", help="skip the block-size sweep and the profile")
    parser.add_argument("--sweep-only", default=None,
                        help="comma-separated row counts: only the sweep at those (no table, no profile)")
    parser.add_argument("--profile-only", action="store_true", help="only the per-kernel profile (profile)")
    parser.add_argument("--pdl-ab", default=None,
                        help="comma-separated row counts: only the PDL on / off A/B at those (pdl_ab)")
    parser.add_argument("--blocks-ab", default=None, type=int,
                        help="a row count of BLOCKS_AB: only its default / candidate A/B (blocks_ab)")
    parser.add_argument("--prefill", default=None,
                        help="comma-separated row counts (e.g. 256,512,2048,4096): only the prefill chunks (bench_prefill)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe.py needs CUDA")
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    layers = make_layers(gen)
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "shape": dict(C=HIDDEN, I=WIDTH, E=EXPERTS, k=TOP_K, dtype="bfloat16"),
               "layers_per_call": LAYERS, "nominal_bw": NOMINAL_BW, "copy_bw": bandwidth, "rows": []}
    only = None if args.sweep_only is None else {int(r) for r in args.sweep_only.split(",")}
    if args.profile_only:
        results["profile"] = profile(layers, gen)
        only = set()
    if args.pdl_ab is not None:  # the A/B alone (with --sweep-only, that sweep too)
        results["pdl_ab"] = pdl_ab(layers, gen, [int(r) for r in args.pdl_ab.split(",")])
        only = only or set()
    if args.blocks_ab is not None:
        results["blocks_ab"] = blocks_ab(layers, gen, args.blocks_ab)
        only = only or set()
    if args.prefill is not None:
        results["matmul_rate"] = matmul_rate()
        results["prefill"] = []
        for rows in (int(r) for r in args.prefill.split(",")):
            results["prefill"].append(bench_prefill(rows, layers, gen, results["matmul_rate"]))
            print(f"prefill N={rows} done at {time.perf_counter() - start:.1f} s", flush=True)
        only = only or set()
    for rows in ROWS if only is None else ():
        results["rows"].append(bench_rows(rows, layers, gen, bandwidth))
        print(f"N={rows} done at {time.perf_counter() - start:.1f} s", flush=True)
    if only is not None:
        if only:
            results["sweep"] = sweep(layers, gen, only)
    elif not args.no_sweep:
        results["sweep"] = sweep(layers, gen)
        try:
            results["profile"] = profile(layers, gen)
        except Exception as e:  # the profiler is an extra: its absence must not lose the run
            results["profile_error"] = repr(e)
    results["seconds"] = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)

    print()
    for r in results.get("pdl_ab", []):
        print(f"pdl_ab N={r['rows']:<4} {r['variant']:18s} {r['graph_us']:8.1f} us/layer  "
              f"{100 * r['fraction_of_floor']:5.1f}% of floor  rounds "
              + " ".join(f"{t:.1f}" for t in r["rounds_us"])
              + ("" if r["bitwise_equal_to_pdl_off"] else "  BITS DIFFER"))
    for p in results.get("profile", []):
        print(f"profile N={p['rows']:<4} {p['kernel'][:40]:40s} {p['us_per_layer']:8.1f} us/layer")
    for r in results.get("blocks_ab", []):
        print(f"blocks_ab N={r['rows']:<4} {r['variant']:12s} {r['graph_us']:8.1f} us/layer  "
              f"{100 * r['fraction_of_floor']:5.1f}% of floor  rounds {' '.join(f'{t:.1f}' for t in r['rounds_us'])}"
              f"  rms_rel {r['rms_rel_vs_torch']:.1e}  {r['blocks']}")
    for s in results.get("sweep", []):
        b = s["blocks"]
        form = f"split d{b['block_d']}" if b.get("split") else "fused"
        print(f"sweep N={s['rows']:<4} {form:10s} m{b['block_m']} i{b['block_i']} k{b['block_k']} c{b['block_c']} "
              f"st{b['num_stages']} w{b['num_warps']} s{b['sum_block_c']}: {s['graph_us']:8.1f} us  "
              f"{100 * s['fraction_of_floor']:5.1f}% of floor"
              + ("" if s.get("numeric_ok", True) else "  NUMERIC FAIL"))
    if "prefill" in results:
        print(f"prefill: bf16 matmul {results['matmul_rate'] / 1e12:.0f} TFLOP/s (measured), weights at "
              f"{NOMINAL_BW / 1e12:.2f} TB/s; us per layer")
        print(f"{'N':>5} {'experts':>7} {'flop fl':>8} {'byte fl':>8} {'graph us':>9} {'floor %':>7} {'TFLOP/s':>7} "
              f"{'torch us':>9} {'x torch':>7} {'per-pair':>9} {'rms-rel':>8} exact")
        for r in results["prefill"]:
            exact = "yes" if r["runs_bitwise_equal"] and r["graph_bitwise_equal"] else "NO"
            per_pair = f"{r['per_pair_graph_us']:>9.1f}" if "per_pair_graph_us" in r else f"{'-':>9}"
            print(f"{r['rows']:>5} {r['distinct_experts']:>7.1f} {r['flops_floor_us']:>8.1f} {r['bytes_floor_us']:>8.1f} "
                  f"{r['graph_us']:>9.1f} {100 * r['fraction_of_floor']:>6.1f}% {r['tflops']:>7.1f} "
                  f"{r['torch_us']:>9.1f} {r['speedup_vs_torch']:>7.1f} {per_pair} {r['rms_rel_vs_torch']:>8.1e} {exact}"
                  + ("" if r["numeric_ok"] else "  NUMERIC FAIL"))
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s (floor below at {NOMINAL_BW / 1e12:.2f}); "
          f"{results['seconds']:.1f} s in all")
    print(f"{'N':>4} {'experts':>7} {'floor us':>9} {'graph us':>9} {'floor %':>7} {'eager us':>9} {'torch us':>9} "
          f"{'x torch':>7} {'rms-rel':>8} exact")
    for r in results["rows"]:
        exact = "yes" if r["runs_bitwise_equal"] and r["graph_bitwise_equal"] else "NO"
        print(f"{r['rows']:>4} {r['distinct_experts']:>7.1f} {r['floor_us']:>9.1f} {r['graph_us']:>9.1f} "
              f"{100 * r['fraction_of_floor']:>6.1f}% {r['triton_eager_us']:>9.1f} {r['torch_us']:>9.1f} "
              f"{r['speedup_vs_torch']:>7.1f} {r['rms_rel_vs_torch']:>8.1e} {exact}"
              + ("" if r["numeric_ok"] else "  NUMERIC FAIL"))


if __name__ == "__main__":
    main()
