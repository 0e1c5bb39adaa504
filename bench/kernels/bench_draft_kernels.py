"""The draft's selector top-K at the released 35B-A3B draft's shapes, swept over its block size (issue 8:
the draft forward is verify-only time).

    top_candidates      the selector's block + merge top-16 over V      fast/kernels/selector.py
                        at BLOCK_V in {256 .. 4096}, each checked equal to BLOCK_V = 1024

V = 248320, 7 rows (one request's k = 7 slots), bf16 logits. Times: device microseconds per call from a CUDA
graph of the call, replayed (triton's do_bench median, L2 flushed between replays).

(perf6 call 4 also timed a fused norm + W_kp GEMM + conv-prepare kernel here against the three launches it
would replace: 11.0 vs 9.25 us at one request, so it was dropped; bench/results/2026-12-02-h200-perf6.)

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_draft_kernels.py --out result.json     # from the repo root
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from dflash2.bench.measure import graph_replay_us
from dflash2.fast.kernels.selector import top_candidates_triton

V, SLOTS = 248320, 7
BLOCK_VS = (256, 512, 1024, 2048, 4096)


def bench_topk(gen: torch.Generator) -> list[dict]:
    results = []
    logits = torch.randn(1, SLOTS, V, device="cuda", generator=gen).bfloat16()
    want = top_candidates_triton(logits, 16, 1024)
    for block_v in BLOCK_VS:
        got = top_candidates_triton(logits, 16, block_v)
        exact = torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        us = graph_replay_us(lambda block_v=block_v: top_candidates_triton(logits, 16, block_v))
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
               "triton": triton.__version__, "shape": dict(V=V, slots=SLOTS, dtype="bfloat16"),
               "rows": bench_topk(gen)}
    results["seconds"] = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
