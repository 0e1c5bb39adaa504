"""The skinny-M linear (fast/kernels/dense/skinny_linear.py) against cuBLAS (torch's matmul) at the draft's GEMM
shapes, 8 rows a request (issue 8: the draft forward is verify-only time), beside each shape's floor.

    35B-A3B draft (C = 2048): the conv kernel projection [512, C], q|k|v [3072, C], o [C, 2048],
                              gate|up with the SwiGLU epilogue [2 x 5632, C], down [C, 5632], fc [C, 5 C]
    27B draft (C = 5120):     the same six ([1280, C], [6144, C], [C, 4096], [2 x 17408, C], [C, 17408], [C, 5 C]),
                              also at 128 rows (16 requests' blocks, issue 32)
    35B-A3B target (for the record, not wired): GDN in_proj [12288, C] and out_proj [C, 4096] at 1 and 8 rows
    27B target (issue 32: the verify forward of 16 requests, 128 rows, against the 16-row decode): GDN in_proj
                              [16480, C], out_proj [C, 6144], attention q|k|v [14336, C], o [C, 6144], gate|up with
                              the SwiGLU epilogue [2 x 17408, C], down [C, 17408], at 16 and 128 rows; rows past
                              32 sweep 64- and 128-row tiles (``SkinnyConfig.block_m``) with wider column tiles

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
    *[(f"27b.{name}", 128, n, k, swiglu) for name, n, k, swiglu in (
        ("kernel_proj", 1280, 5120, False), ("qkv", 6144, 5120, False), ("o", 5120, 4096, False),
        ("gate_up", 17408, 5120, True), ("down", 5120, 17408, False), ("fc", 5120, 25600, False))],
    ("35b-target.in_proj", 1, 12288, 2048, False), ("35b-target.in_proj", 8, 12288, 2048, False),
    ("35b-target.out_proj", 1, 2048, 4096, False), ("35b-target.out_proj", 8, 2048, 4096, False),
    *[(f"27b-target.{name}", rows, n, k, swiglu) for rows in (16, 128) for name, n, k, swiglu in (
        ("gdn_in", 16480, 5120, False), ("gdn_out", 5120, 6144, False), ("qkv", 14336, 5120, False),
        ("o", 5120, 6144, False), ("gate_up", 17408, 5120, True), ("down", 5120, 17408, False))],
]
# (block_m, block_n, block_k, num_warps, num_stages) for a verify block's rows (past 32): a tile of the whole
# block or half of it, wide enough in N for the tensor cores, stages that fit the shared memory
VERIFY_TILES = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 64, 128, 8, 3),
                (128, 128, 64, 8, 3)]


def configs_for(rows: int, n: int, k: int) -> list[SkinnyConfig]:
    """Up to 32 rows: column tiles of 16 and 32, K steps of 128 and 256, split-K 1..16 where it keeps 64-2048
    programs, each without the L2 prefetch of its weight slice, with it over the first 512 K columns, and over all
    of them. Past 32 rows: each of :data:`VERIFY_TILES` at split-K 1, 2 and 4."""
    out = []
    if rows > 32:
        for block_m, block_n, block_k, warps, stages in VERIFY_TILES:
            for split in (1, 2, 4):
                if k // split >= block_k:
                    out.append(SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=warps,
                                            num_stages=stages, block_m=block_m))
        return out
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


def bench_shape(name, rows, n, k, swiglu, bandwidth, gen, sweep: bool = True) -> list[dict]:
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
    for cfg in dict.fromkeys(configs_for(rows, n, k) + [default]) if sweep else ():
        try:
            got = skinny_linear_triton(x, weights[0], swiglu, config=cfg)
        except triton.runtime.errors.OutOfResources as e:  # a tile and stage count past the shared memory
            print(f"  {cfg}: does not fit ({e})", flush=True)
            continue
        err = rms_rel(got.float(), want.float())
        if not err <= 2e-2:
            print(f"  {cfg}: WRONG (rms-relative {err:.2e})", flush=True)
            results.append({"shape": name, "rows": rows, "impl": "skinny", "config": cfg.__dict__, "error": err})
            continue
        us = graph_replay_us(lambda cfg=cfg: [skinny_linear_triton(x, w, swiglu, config=cfg) for w in weights], copies)
        tag = " (default)" if cfg == default else ""
        prefetch = f" pf{min(cfg.prefetch_k, 9999):<4d}" if cfg.prefetch_k else " " * 7
        print(f"  bm{cfg.block_m or '-':<4} bn{cfg.block_n:<4d} bk{cfg.block_k:<4d} w{cfg.num_warps} s{cfg.num_stages} "
              f"split{cfg.split_k:<3d}{prefetch}: {us:6.2f} us "
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
    parser.add_argument("--rows", default="", help="comma-separated row counts to run (default: all)")
    parser.add_argument("--no-sweep", action="store_true", help="cuBLAS and the floor only")
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
        if args.rows and shape[1] not in {int(r) for r in args.rows.split(",")}:
            continue
        rows += bench_shape(*shape, bandwidth, gen, sweep=not args.no_sweep)
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "bandwidth_gbs": bandwidth / 1e9, "rows": rows,
               "seconds": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
