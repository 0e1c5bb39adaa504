"""MoE router benchmark: the Triton router (fast/kernels/moe/moe_router.py, two kernels) against its torch
twin (fast/kernels/moe/moe_router.route_torch: fp32 GEMM, softmax, stable sort, renormalise) and the
former torch.topk sequence, beside the floor.

    Qwen3.5-35B-A3B: E = 256, C = 2048, k = 8; a larger router: E = 512, C = 4096, k = 10; bf16 x
    N in {1, 8, 32, 128} rows
    floor = E C x 4 bytes (W_router, fp32) / bandwidth     (2 MiB at E = 256, C = 2048)

Each timed call runs as many routers as make 256 MiB (128 at E = 256), each with its own W_router
(so it comes from HBM, not the 50 MiB L2, as in a real step); times are per layer, of CUDA-graph
replays (median of CUDA events; the graph is what the engine replays, and capturing it proves the
op capturable). Checks on fresh random data: ids equal to the torch twin's (EXACT; a near tie at a
rank boundary would show as a mismatch beside a tiny twin_min_rel_gap), weights within 1e-6
rms-relative of the twin's (the max relative error is reported too: about one ulp of the largest
logit, ~1e-6 at |logit| ~ 8, as the two GEMVs round apart), a graph replay bitwise equal to the
eager call. Beside the kernel, the prefill chunks' form (``gemm=True``: the logits by one fp32 cuBLAS GEMM,
then kernel 2), where ``moe_router.GEMM_ROWS`` should sit (``--rows``). A short sweep of block sizes at each
shape follows the default (C split across programs among them). Bandwidth: the nominal 4.25e12 B/s and a device-to-device copy measured here.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_moe_router.py --out result.json     # from the repo root
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch

from dflash2.bench.measure import copy_bandwidth, graph_seconds, rms_rel
from dflash2.fast.kernels.moe.moe_router import RouterBlocks, default_blocks, route_torch, route_triton

SHAPES = ((256, 2048, 8), (512, 4096, 10))  # (E, C, k)
ROWS = (1, 8, 32, 128)
WEIGHTS_RMS_REL = 1e-6  # the weights' check, rms-relative: 10x under fp32 NUMERIC (1e-5)
ROUTER_BYTES = 256 << 20  # routers per graph: 256 MiB of them, > the 50 MiB L2, so each is read from HBM
NOMINAL_BW = 4.25e12
SWEEP = (RouterBlocks(1, 1, 2048), RouterBlocks(1, 4, 1024), RouterBlocks(1, 2, 4096, num_warps=8),
         RouterBlocks(8, 2, 512), RouterBlocks(8, 8, 128), RouterBlocks(8, 1, 1024), RouterBlocks(8, 1, 2048, num_warps=8),
         RouterBlocks(8, 2, 1024, num_warps=8), RouterBlocks(16, 8, 64),
         RouterBlocks(16, 16, 32, num_warps=8),
         # C split across programs (the > 8-row defaults are of these, unmeasured): 8 rows, then 16
         RouterBlocks(8, 1, 512, num_warps=4, num_splits=4), RouterBlocks(8, 2, 256, num_splits=8),
         RouterBlocks(8, 1, 1024, num_warps=8, num_splits=2),
         RouterBlocks(16, 8, 256, num_splits=8), RouterBlocks(16, 4, 128, num_splits=16),
         RouterBlocks(16, 16, 64, num_splits=8), RouterBlocks(16, 8, 64, num_splits=16),
         RouterBlocks(16, 8, 128, num_warps=8, num_splits=8), RouterBlocks(16, 8, 128, num_warps=8, num_splits=2))
SWEEP_UNTIL_S = 90  # the sweep is skipped past this many seconds (compiles), to stay under two minutes


def topk_sequence(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's former inline router (torch.topk): the profile's ~5 launches per layer."""
    probs = torch.softmax(x.float() @ w_router.T, dim=-1)
    top_probs, expert_ids = torch.topk(probs, top_k, dim=-1)
    return expert_ids, top_probs / top_probs.sum(dim=-1, keepdim=True)


def check(x, w_router, top_k) -> dict:
    """Triton vs the torch twin on one router: ids, weights, replay exactness."""
    ids, weights = route_triton(x, w_router, top_k)
    want_ids, want_weights = route_torch(x, w_router, top_k)
    rows_differ = int((ids != want_ids).any(dim=1).sum())
    max_rel = float(((weights - want_weights).abs() / want_weights.abs().clamp_min(1e-30)).max())
    graph = torch.cuda.CUDAGraph()
    route_triton(x, w_router, top_k)
    with torch.cuda.graph(graph):
        captured = route_triton(x, w_router, top_k)
    captured[1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replay_exact = bool(torch.equal(captured[0], ids) and torch.equal(captured[1], weights))
    probs = torch.softmax(x.float() @ w_router.T, dim=-1).sort(dim=-1, descending=True).values[:, :top_k + 1]
    min_gap = float(((probs[:, :-1] - probs[:, 1:]) / probs[:, :-1]).min())
    weights_rms_rel = rms_rel(weights, want_weights)
    return {"rows_ids_differ": rows_differ, "weights_max_rel": max_rel, "weights_rms_rel": weights_rms_rel,
            "replay_exact": replay_exact, "twin_min_rel_gap": min_gap,
            "ok": rows_differ == 0 and weights_rms_rel <= WEIGHTS_RMS_REL and replay_exact}


def bench_shape(experts: int, hidden: int, top_k: int, bandwidth: float, gen: torch.Generator,
                start: float, rows_list=ROWS) -> list[dict]:
    w_bytes = experts * hidden * 4
    layers_per_graph = max(ROUTER_BYTES // w_bytes, 1)
    routers = [torch.randn(experts, hidden, device="cuda", generator=gen) * 2 * hidden ** -0.5
               for _ in range(layers_per_graph)]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
        checks = check(x, routers[0], top_k)

        def layers(fn, **kw):
            return lambda: [fn(x, w, top_k, **kw) for w in routers]

        t_triton = graph_seconds(layers(route_triton, gemm=False)) / layers_per_graph
        t_gemm = graph_seconds(layers(route_triton, gemm=True)) / layers_per_graph  # prefill chunks' form
        t_twin = graph_seconds(layers(route_torch)) / layers_per_graph
        t_topk = graph_seconds(layers(topk_sequence)) / layers_per_graph
        sweep = []
        default = default_blocks(rows, experts, hidden)
        for blocks in SWEEP:
            if blocks.block_n != default.block_n or blocks == default or time.time() - start > SWEEP_UNTIL_S:
                continue
            ids, _ = route_triton(x, routers[0], top_k, blocks=blocks)
            us = 1e6 * graph_seconds(layers(route_triton, blocks=blocks)) / layers_per_graph
            sweep.append({"blocks": asdict(blocks), "us": us,
                          "ids_equal": bool(torch.equal(ids, route_torch(x, routers[0], top_k)[0]))})
        results.append({
            "experts": experts, "hidden": hidden, "top_k": top_k, "rows": rows, "layers_per_graph": layers_per_graph,
            "blocks": asdict(default), **checks,
            "triton_us": 1e6 * t_triton, "gemm_logits_us": 1e6 * t_gemm, "torch_twin_us": 1e6 * t_twin,
            "topk_sequence_us": 1e6 * t_topk,
            "floor_nominal_us": 1e6 * w_bytes / NOMINAL_BW, "floor_measured_us": 1e6 * w_bytes / bandwidth,
            "fraction_of_floor": (w_bytes / NOMINAL_BW) / t_triton, "sweep": sweep})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rows", default=None, help="row counts, e.g. 16,64,128,256,512,2048 (default 1,8,32,128)")
    parser.add_argument("--only-35b", action="store_true", help="only the 35B-A3B router (E 256, C 2048, k 8)")
    args = parser.parse_args()
    start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False  # the twin's GEMM in fp32, as in the engine
    bandwidth = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = tuple(int(n) for n in args.rows.split(",")) if args.rows else ROWS
    shapes = SHAPES[:1] if args.only_35b else SHAPES
    results = [r for shape in shapes for r in bench_shape(*shape, bandwidth, gen, start, rows)]
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bandwidth,
              "nominal_bandwidth": NOMINAL_BW, "results": results,
              "seconds": time.time() - start}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{record['gpu']}: copy {bandwidth / 1e12:.2f} TB/s; per layer, graph replays of 256 MiB of routers")
    print(f"{'E':>4} {'C':>5} {'k':>3} {'N':>4} {'ok':>3} {'ids!=':>5} {'w rms':>8} {'w max':>8} {'triton us':>9} "
          f"{'best us':>8} {'gemm us':>8} {'twin us':>8} {'topk us':>8} {'floor us':>8} {'of floor':>8}")
    for r in results:
        best = min([r["triton_us"]] + [s["us"] for s in r["sweep"]])
        print(f"{r['experts']:4d} {r['hidden']:5d} {r['top_k']:3d} {r['rows']:4d} {'yes' if r['ok'] else 'NO':>3} "
              f"{r['rows_ids_differ']:5d} {r['weights_rms_rel']:8.1e} {r['weights_max_rel']:8.1e} "
              f"{r['triton_us']:9.2f} {best:8.2f} {r['gemm_logits_us']:8.2f} "
              f"{r['torch_twin_us']:8.2f} {r['topk_sequence_us']:8.2f} {r['floor_nominal_us']:8.2f} "
              f"{100 * r['fraction_of_floor']:7.1f}%")
    print(f"total {record['seconds']:.0f} s; written {args.out}")


if __name__ == "__main__":
    main()
