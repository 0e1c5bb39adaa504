"""The skinny-M linear (fast/kernels/dense/skinny_linear.py) against cuBLAS (torch's matmul) at the draft's GEMM
shapes, 8 rows a request (issue 8: the draft forward is verify-only time), beside each shape's floor.

    35B-A3B draft (C = 2048): the conv kernel projection [512, C], q|k|v [3072, C], o [C, 2048],
                              gate|up with the SwiGLU epilogue [2 x 5632, C], down [C, 5632], fc [C, 5 C]
    27B draft (C = 5120):     the same six ([1280, C], [6144, C], [C, 4096], [2 x 17408, C], [C, 17408], [C, 5 C])
    35B-A3B target (for the record, not wired): GDN in_proj [12288, C] and out_proj [C, 4096] at 1 and 8 rows

Each case is a CUDA graph of back-to-back calls, each on its own copy of the weight (copies enough to
hold >= 256 MiB, so nothing stays in the 60 MiB L2 between calls, as in the step), replayed under
triton's do_bench (bench/measure.graph_replay_us: median, L2 flushed between replays); us per call.
cuBLAS's swiglu case is the GEMM plus the engine's activation kernel (what the draft runs without this
kernel). Floor: the weight's bytes over the copy bandwidth measured here (bench/measure.copy_bandwidth,
as ft bench's floors). Every config's output is checked against cuBLAS (rms-relative <= 2e-2 in bf16)
before it is timed.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_skinny_linear.py --out result.json     # from the repo root
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from dflash2.bench.measure import copy_bandwidth, graph_replay_us, rms_rel
from dflash2.fast.kernels.dense.skinny_linear import SkinnyConfig, default_config, skinny_linear_triton
from dflash2.fast.kernels.dense.swiglu import swiglu_act_triton

MIN_BYTES = 256 << 20
PREFETCH_KS = (0, 512, 1 << 20)  # SkinnyConfig.prefetch_k: none, the first 512 K columns of a split, all

SHAPES = [  # name, rows, N (outputs; I with swiglu), K, swiglu
    ("35b.kernel_proj", 8, 512, 2048, False), ("35b.qkv", 8, 3072, 2048, False), ("35b.o", 8, 2048, 2048, False),
    ("35b.gate_up", 8, 5632, 2048, True), ("35b.down", 8, 2048, 5632, False), ("35b.fc", 8, 2048, 10240, False),
    ("35b.kernel_proj", 32, 512, 2048, False), ("35b.qkv", 32, 3072, 2048, False), ("35b.o", 32, 2048, 2048, False),
    ("35b.gate_up", 32, 5632, 2048, True), ("35b.down", 32, 2048, 5632, False),
    ("27b.kernel_proj", 8, 1280, 5120, False), ("27b.qkv", 8, 6144, 5120, False), ("27b.o", 8, 5120, 4096, False),
    ("27b.gate_up", 8, 17408, 5120, True), ("27b.down", 8, 5120, 17408, False), ("27b.fc", 8, 5120, 25600, False),
    ("35b-target.in_proj", 1, 12288, 2048, False), ("35b-target.in_proj", 8, 12288, 2048, False),
    ("35b-target.out_proj", 1, 2048, 4096, False), ("35b-target.out_proj", 8, 2048, 4096, False),
]


def configs_for(rows: int, n: int, k: int) -> list[SkinnyConfig]:
    """Column tiles of 16 and 32, K steps of 128 and 256, split-K 1..16 where it keeps 64-2048 programs, each
    without the L2 prefetch of its weight slice, with it over the first 512 K columns, and over all of them."""
    out = []
    m_tiles = triton.cdiv(rows, 64)
    for block_n in (16, 32):
        for block_k in (128, 256):
            for split in (1, 2, 4, 8, 16):
                programs = triton.cdiv(n, block_n) * m_tiles * split
                if k // split < block_k or not 64 <= programs <= 2048 and split > 1:
                    continue
                for prefetch_k in PREFETCH_KS:
                    out.append(SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, prefetch_k=prefetch_k))
    return out


def bench_shape(name, rows, n, k, swiglu, bandwidth, gen) -> list[dict]:
    out_n = 2 * n if swiglu else n
    weight_bytes = out_n * k * 2
    copies = max(1, -(-MIN_BYTES // weight_bytes))
    weights = [torch.randn(out_n, k, device="cuda", generator=gen).mul_(k ** -0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    floor_us = weight_bytes / bandwidth * 1e6

    def cublas():
        for w in weights:
            y = x @ w.T
            if swiglu:
                swiglu_act_triton(y)

    want = x @ weights[0].T
    if swiglu:
        want = swiglu_act_triton(want)
    base_us = graph_replay_us(cublas, copies)
    print(f"{name} rows={rows} N={n} K={k}{' swiglu' if swiglu else ''}: floor {floor_us:6.2f} us, "
          f"cuBLAS {base_us:6.2f} us ({100 * floor_us / base_us:4.1f}%)", flush=True)
    results = [{"shape": name, "rows": rows, "n": n, "k": k, "swiglu": swiglu, "impl": "cublas", "us": base_us,
                "floor_us": floor_us}]
    default = default_config(rows, n, k, swiglu)
    for cfg in dict.fromkeys(configs_for(rows, n, k) + [default]):
        got = skinny_linear_triton(x, weights[0], swiglu, config=cfg)
        err = rms_rel(got.float(), want.float())
        if not err <= 2e-2:
            print(f"  {cfg}: WRONG (rms-relative {err:.2e})", flush=True)
            results.append({"shape": name, "rows": rows, "impl": "skinny", "config": cfg.__dict__, "error": err})
            continue
        us = graph_replay_us(lambda cfg=cfg: [skinny_linear_triton(x, w, swiglu, config=cfg) for w in weights], copies)
        tag = " (default)" if cfg == default else ""
        prefetch = f" pf{min(cfg.prefetch_k, 9999):<4d}" if cfg.prefetch_k else " " * 7
        print(f"  bn{cfg.block_n:<3d} bk{cfg.block_k:<4d} split{cfg.split_k:<3d}{prefetch}: {us:6.2f} us "
              f"({100 * floor_us / us:4.1f}% of floor, {base_us / us:4.2f}x cuBLAS){tag}", flush=True)
        results.append({"shape": name, "rows": rows, "n": n, "k": k, "swiglu": swiglu, "impl": "skinny",
                        "config": cfg.__dict__, "default": cfg == default, "us": us, "floor_us": floor_us,
                        "rms_rel": err})
    weights.clear()
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--only", default="", help="comma-separated shape-name prefixes to run (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_skinny_linear.py needs CUDA")
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    prefixes = [p for p in args.only.split(",") if p]
    rows = []
    for shape in SHAPES:
        if prefixes and not any(shape[0].startswith(p) for p in prefixes):
            continue
        rows += bench_shape(*shape, bandwidth, gen)
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "bandwidth_gbs": bandwidth / 1e9, "rows": rows,
               "seconds": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
