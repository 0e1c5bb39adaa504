"""The draft's selector top-K at the released 35B-A3B draft's shapes, swept over its block size (issue 8:
the draft forward is verify-only time).

    top_candidates      the selector's block + merge top-16 over V      fast/kernels/draft/selector.py
                        at BLOCK_V in {256 .. 4096}, each checked equal to BLOCK_V = 1024
    project             the walk's g = h P^T (k = 7, C = 2048, r = 256)   fast/kernels/draft/selector.py
                        the torch form against project_triton's block_r in {1 .. 16}

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
from dflash2.fast.kernels.draft.selector import project_triton, top_candidates_triton

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


PROJECT_BLOCK_RS = (1, 2, 4, 8, 16)
HIDDEN, RANK, BLOCK = 2048, 256, 16  # the released 35B-A3B draft: hidden size, selector rank, block size


def bench_project(gen: torch.Generator) -> list[dict]:
    """The walk's g = h P^T for one request's k = 7 slots: the torch form (an fp32 copy of h and a cuBLAS fp32
    GEMM, what perf12 ran) against ``project_triton`` at each block of r columns a program, with P in fp32 (as
    the proposer keeps it) and bf16; each checked against the fp64 product."""
    results = []
    hidden = torch.randn(1, BLOCK, HIDDEN, device="cuda", generator=gen).bfloat16()
    for p_dtype in (torch.float32, torch.bfloat16):
        projection = (torch.randn(RANK, HIDDEN, device="cuda", generator=gen) / HIDDEN ** 0.5).to(p_dtype)
        want = hidden[:, 1:SLOTS + 1].double() @ projection.double().T
        variants = {"torch": lambda: (hidden[:, 1:SLOTS + 1].float() @ projection.float().T).contiguous()}
        for block_r in PROJECT_BLOCK_RS:
            variants[f"triton block_r={block_r}"] = lambda block_r=block_r: project_triton(hidden, projection, SLOTS,
                                                                                           block_r=block_r)
        for name, fn in variants.items():
            err = float((fn().double() - want).norm() / want.norm())
            us = graph_replay_us(fn)
            results.append({"op": "project", "p_dtype": str(p_dtype), "variant": name, "us": us, "rel_err": err})
            print(f"project P {str(p_dtype)[6:]:8s} {name:18s}: {us:7.2f} us  rel err {err:.1e}", flush=True)
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
               "rows": bench_topk(gen) + bench_project(gen)}
    results["seconds"] = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
