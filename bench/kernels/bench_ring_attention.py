"""The draft's window attention over its K/V ring (fast/kernels/draft/ring_attention.py) at the released 35B-A3B and
27B drafts' shapes, one request (8 block rows, the window full), swept over the split plan.

    35B-A3B draft: H = 16, Hkv = 4, D = 128, W = 2048;  27B draft: H = 32, Hkv = 8, D = 128, W = 2048
    split_len (context keys a program) x block_n (keys a chunk), beside the default plan (launch_plan)

Each case is a CUDA graph of LAYERS back-to-back calls, each on its own ring (as the draft's layers
are; together more than the L2), replayed under triton's do_bench (median, L2 flushed between
replays): us per call, split and merge kernels together. Floor: the window's K and V bytes over the
copy bandwidth measured here. Every config's output is checked against the default plan's (rms-relative
<= 1e-2 in bf16) before it is timed.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_ring_attention.py --out result.json     # from the repo root
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from dflash2.bench.measure import copy_bandwidth, graph_replay_us, rms_rel
from dflash2.fast.kernels.draft.ring_attention import ring_attention_triton

SHAPES = {"35b-a3b": (16, 4, 128), "27b": (32, 8, 128)}  # H, Hkv, D
WINDOW, CAPACITY, ROWS, LAYERS = 2048, 2112, 8, 32
SPLIT_LENS = (64, 128, 256, 512, 2048)
BLOCK_NS = (32, 64, 128)


def bench_shape(name: str, heads: int, kv_heads: int, dim: int, bandwidth: float, gen) -> list[dict]:
    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

    q, bk, bv = rand(ROWS, heads, dim), rand(ROWS, kv_heads, dim), rand(ROWS, kv_heads, dim)
    rings = [(rand(1, CAPACITY, kv_heads, dim), rand(1, CAPACITY, kv_heads, dim)) for _ in range(LAYERS)]
    slots = torch.zeros(1, dtype=torch.long, device="cuda")
    anchor = torch.full((1,), 5000, dtype=torch.long, device="cuda")  # the window full, wrapping the ring
    floor_us = 2 * (WINDOW - 1) * kv_heads * dim * 2 / bandwidth * 1e6

    def call(**plan):
        return [ring_attention_triton(q, bk, bv, rk, rv, slots, anchor, WINDOW, **plan) for rk, rv in rings]

    want = call()[0].float()
    base_us = graph_replay_us(lambda: call(), LAYERS)
    print(f"{name}: floor {floor_us:5.2f} us, default plan {base_us:6.2f} us", flush=True)
    results = [{"shape": name, "plan": "default", "us": base_us, "floor_us": floor_us}]
    for split_len in SPLIT_LENS:
        for block_n in BLOCK_NS:
            if split_len % block_n:
                continue
            got = call(split_len=split_len, block_n=block_n)[0].float()
            err = rms_rel(got, want)
            if not err <= 1e-2:
                print(f"  split {split_len} block_n {block_n}: WRONG ({err:.2e})", flush=True)
                continue
            us = graph_replay_us(lambda s=split_len, b=block_n: call(split_len=s, block_n=b), LAYERS)
            print(f"  split_len {split_len:5d} block_n {block_n:4d}: {us:6.2f} us ({base_us / us:4.2f}x default)",
                  flush=True)
            results.append({"shape": name, "split_len": split_len, "block_n": block_n, "us": us, "floor_us": floor_us,
                            "rms_rel": err})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ring_attention.py needs CUDA")
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    rows = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        rows += bench_shape(name, heads, kv_heads, dim, bandwidth, gen)
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "bandwidth_gbs": bandwidth / 1e9, "rows": rows,
               "seconds": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
