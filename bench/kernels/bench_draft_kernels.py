"""The draft's per-step small kernels at the released 35B-A3B draft's shapes, each beside the code path it
replaced, with a sweep of its tiling (issue 8: the draft forward is verify-only time).

    norm_conv_prepare   RMSNorm + delta = W_kp u + conv side 0          fast/kernels/conv_prepare.py
                        against add_rms_norm + the cuBLAS GEMM + grouped_dynamic_conv (three launches)
    top_candidates      the selector's block + merge top-16 over V      fast/kernels/selector.py
                        at BLOCK_V in {256 .. 4096}

C = 2048, G = 16, K = 2 taps (W_kp [512, 2048]), S = 8 rows a block, B in {1, 4} blocks; V = 248320, 7 rows a
request. Times: device microseconds per call from a CUDA graph of 16 calls, each on its own weights (the
draft's 8 layers x 2 convs, so W_kp comes from HBM/L2 as in a step), replayed (triton's do_bench median,
L2 flushed between replays). Correctness of each configuration against the unfused form (rms-relative).

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_draft_kernels.py --out result.json     # from the repo root
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from triton.testing import do_bench

from dflash2.bench.measure import rms_rel
from dflash2.fast.kernels.conv_prepare import norm_conv_prepare_triton
from dflash2.fast.kernels.dynamic_conv import grouped_dynamic_conv_triton
from dflash2.fast.kernels.rms_norm import add_rms_norm_triton
from dflash2.fast.kernels.selector import top_candidates_triton

C, G, K, S, V, SLOTS = 2048, 16, 2, 8, 248320, 7
CONVS = 16  # 8 layers x (attention conv, MLP conv)
EPS = 1e-6
CONV_CONFIGS = [dict(max_block_k=bk, num_warps=w, groups_per_program=gt)
                for bk in (256, 512, 1024) for w in (4, 8) for gt in (1, 4)]
BLOCK_VS = (256, 512, 1024, 2048, 4096)


def graph_us(fn, calls: int) -> float:
    """Device us per call of a CUDA graph holding ``calls`` calls (fn makes them all)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3 / calls


def unfused(x, w, proj, base):
    """The draft's path before norm_conv_prepare: three launches."""
    rows = x.reshape(-1, C)
    u = add_rms_norm_triton(rows, None, w, EPS, x.dtype)[1]
    delta = (u @ proj.T).view(x.shape[0], S, 2, K, C // G)
    return grouped_dynamic_conv_triton(u.view(x.shape), base[0], delta[:, :, 0], G), delta


def bench_conv(gen: torch.Generator) -> list[dict]:
    results = []
    for blocks in (1, 4):
        xs = [torch.randn(blocks, S, C, device="cuda", generator=gen).bfloat16() for _ in range(CONVS)]
        ws = [1 + 0.1 * torch.randn(C, device="cuda", generator=gen) for _ in range(CONVS)]
        projs = [(torch.randn(2 * K * C // G, C, device="cuda", generator=gen) * C ** -0.5).bfloat16()
                 for _ in range(CONVS)]
        bases = [(torch.randn(2, K, C, device="cuda", generator=gen) * 0.5).bfloat16() for _ in range(CONVS)]
        args = list(zip(xs, ws, projs, bases))
        want = [unfused(*a) for a in args]
        us = graph_us(lambda: [unfused(*a) for a in args], CONVS)
        results.append({"op": "conv_prepare", "B": blocks, "form": "unfused (3 launches)", "us": us})
        print(f"conv B={blocks} unfused: {us:7.2f} us", flush=True)
        for cfg in CONV_CONFIGS:
            got = [norm_conv_prepare_triton(x, w, EPS, p, b, G, **cfg) for x, w, p, b in args]
            err = max(max(rms_rel(g[0], r[0]), rms_rel(g[1], r[1])) for g, r in zip(got, want))
            us = graph_us(lambda cfg=cfg: [norm_conv_prepare_triton(x, w, EPS, p, b, G, **cfg) for x, w, p, b in args],
                          CONVS)
            results.append({"op": "conv_prepare", "B": blocks, "form": "fused", **cfg, "us": us, "rms_rel": err})
            print(f"conv B={blocks} fused {cfg}: {us:7.2f} us  rms-rel {err:.2e}", flush=True)
    return results


def bench_topk(gen: torch.Generator) -> list[dict]:
    results = []
    logits = torch.randn(1, SLOTS, V, device="cuda", generator=gen).bfloat16()
    want = top_candidates_triton(logits, 16, 1024)
    for block_v in BLOCK_VS:
        got = top_candidates_triton(logits, 16, block_v)
        exact = torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        us = graph_us(lambda block_v=block_v: top_candidates_triton(logits, 16, block_v), 1)
        results.append({"op": "top_candidates", "block_v": block_v, "us": us, "equal_to_1024": exact})
        print(f"top_candidates BLOCK_V={block_v}: {us:7.2f} us  equal {exact}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_draft_kernels.py needs CUDA")
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "shape": dict(C=C, G=G, K=K, S=S, V=V, slots=SLOTS, dtype="bfloat16"),
               "rows": bench_conv(gen) + bench_topk(gen)}
    results["seconds"] = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
