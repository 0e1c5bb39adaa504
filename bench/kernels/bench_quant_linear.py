"""The GGUF-quantized linear (fast/kernels/quant) at the released targets' projection shapes, Q4_K and IQ3_XXS, at
N = 1, 8 and 16 rows of x (decode and verify), each beside its floor.

Shapes (bench/shapes/*/config.json through the reference's expected_target_shapes; one full-attention layer,
one GDN layer and the MLP, every distinct [R, K] of at least 256 rows):

    27B      (C = 5120): q|gate [12288, C], k and v [1024, C], o [C, 6144], GDN qkv [10240, C], z [6144, C],
                         out [C, 6144], gate and up [17408, C], down [C, 17408]
    35B-A3B  (C = 2048): q|gate [8192, C], k and v [512, C], o [C, 4096], GDN qkv [8192, C], z [4096, C],
                         one expert's gate|up [1024, C] and down [C, 512], the shared expert's gate and up [512, C]

Per case (bf16 x): ``fused`` the fused kernel (quant_matmul_triton) at its default config and at each config of
a small sweep (``--sweep``); ``dequant+mm`` the other path of quant_linear (the dequantize kernel to bf16, then
cuBLAS), whose time against the fused one's is what sets quant_linear.FUSED_MAX_ROWS; ``bf16 mm`` cuBLAS on a
bf16 copy of the weight (what an unquantized engine reads, for scale). And per shape ``dequant`` the dequantize
kernel alone (the prefill path's first half). Floors: the quantized bytes over the copy bandwidth measured here
(bench/measure.copy_bandwidth) for the products; quantized bytes read plus bf16 bytes written for ``dequant``.

Each case is a CUDA graph of back-to-back calls, each on its own copy of the weight (copies enough to hold
>= 256 MiB, so nothing stays in L2 between calls, as in a step), replayed under triton's do_bench
(bench/measure.graph_replay_us); us per call. Every output is checked against cuBLAS on the dequantized weight
(rms-relative <= 2e-2) before it is timed.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_quant_linear.py --out result.json     # from the repo root
    ... --only 27b.down,35b.expert --rows 1,8,16,32,64 --sweep
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import triton

from dflash2.bench.measure import copy_bandwidth, graph_replay_us, rms_rel
from dflash2.fast.kernels.quant.dequant_triton import dequantize_triton
from dflash2.fast.kernels.quant.layout import Q, QuantWeight, block_shape, row_bytes
from dflash2.fast.kernels.quant.quant_matmul import QuantMatmulConfig, default_config, quant_matmul_triton
from dflash2.reference.formats.config import load_target_config
from dflash2.reference.formats.weights import expected_target_shapes

MIN_BYTES = 256 << 20
SHAPES_DIR = Path(__file__).resolve().parents[1] / "shapes"
MODELS = {"27b": "qwen3.5-27b", "35b": "qwen3.5-35b-a3b"}
QTYPES = (Q.Q4_K, Q.IQ3_XXS)
HALF_FIELDS = {Q.Q4_K: (0, 2), Q.IQ3_XXS: (0,)}  # byte offsets of the fp16 fields in a block
SWEEP = [QuantMatmulConfig(block_r=br, split_k=s, num_warps=w) for br, w in ((16, 4), (32, 4), (64, 8))
         for s in (1, 2, 4)]


def projection_shapes(key: str) -> list[tuple[str, int, int]]:
    """(name, R, K) of every distinct projection of a full-attention layer, a GDN layer and the MLP of a model."""
    cfg = load_target_config(SHAPES_DIR / MODELS[key])
    full = cfg.layer_types.index("full_attention")
    linear = cfg.layer_types.index("linear_attention")
    shapes = expected_target_shapes(cfg)
    seen, out = set(), []
    for name, shape in shapes.items():
        if not (name.startswith(f"layers.{full}.") or name.startswith(f"layers.{linear}.")):
            continue
        if name.endswith("mlp.gate.weight") or "norm" in name or "conv1d" in name:
            continue
        rk = tuple(shape[-2:])  # stacked experts: one expert's matrix
        if len(rk) != 2 or rk[0] < 256 or rk in seen:
            continue
        seen.add(rk)
        short = name.split(".", 2)[2].replace(".weight", "").replace("self_attn.", "").replace("linear_attn.", "gdn.")
        out.append((f"{key}.{short}", rk[0], rk[1]))
    return out


def random_weight(qtype, rows: int, cols: int, gen: np.random.Generator, device: str) -> QuantWeight:
    """Random blocks with moderate finite fp16 scales (conformance/ops/test_quant_dequant.random_bytes's rule)."""
    raw = gen.integers(0, 256, (rows, row_bytes(qtype, cols)), dtype=np.uint8)
    blocks = raw.reshape(-1, block_shape(qtype)[1])
    for offset in HALF_FIELDS[qtype]:
        half = gen.uniform(1.0, 2.0, blocks.shape[0]) * 2.0 ** -10
        blocks[:, offset:offset + 2] = half.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return QuantWeight.from_bytes(raw, qtype, (rows, cols), device=device)


def bench_shape(name, r, k, qtype, rows_list, sweep, bandwidth, gen) -> list[dict]:
    base = random_weight(qtype, r, k, gen, "cuda")
    qbytes = base.nbytes
    copies = max(1, -(-MIN_BYTES // qbytes))
    weights = [QuantWeight(base.data.clone(), qtype, base.shape) for _ in range(copies)]
    base_dense = dequantize_triton(base, torch.bfloat16)
    dense_copies = max(1, -(-MIN_BYTES // (base_dense.numel() * 2)))
    denses = [base_dense.clone() for _ in range(dense_copies)]
    scratch = torch.empty((r, k), dtype=torch.bfloat16, device="cuda")  # one buffer, as an engine would reuse
    tag = f"{name} {qtype.name} [{r}, {k}]"
    results = []

    floor_dq = (qbytes + 2 * r * k) / bandwidth * 1e6
    us = graph_replay_us(lambda: [dequantize_triton(w, torch.bfloat16, out=scratch) for w in weights], copies)
    print(f"{tag}: {qbytes / 2**20:.1f} MiB; dequant {us:7.2f} us (floor {floor_dq:6.2f}, "
          f"{100 * floor_dq / us:4.1f}%)", flush=True)
    results.append({"shape": name, "qtype": qtype.name, "r": r, "k": k, "impl": "dequant", "us": us,
                    "floor_us": floor_dq, "bytes": qbytes})
    floor = qbytes / bandwidth * 1e6
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda").bfloat16()
        want = (x.float() @ base_dense.float().T)

        def dequant_mm(x=x):
            for w in weights:
                dequantize_triton(w, torch.bfloat16, out=scratch)
                x @ scratch.T

        dq_us = graph_replay_us(dequant_mm, copies)
        bf16_us = graph_replay_us(lambda x=x: [x @ d.T for d in denses], dense_copies)
        row = {"shape": name, "qtype": qtype.name, "r": r, "k": k, "rows": rows, "floor_us": floor, "bytes": qbytes}
        results.append({**row, "impl": "dequant+mm", "us": dq_us})
        results.append({**row, "impl": "bf16 mm", "us": bf16_us, "floor_us": 2 * r * k / bandwidth * 1e6})
        print(f"  N={rows:<3d} floor {floor:6.2f} us | dequant+mm {dq_us:7.2f} | bf16 mm {bf16_us:7.2f}", flush=True)
        default = default_config(rows, r, k, qtype)
        for cfg in dict.fromkeys([default] + (SWEEP if sweep else [])):
            got = quant_matmul_triton(x, base, cfg)
            err = rms_rel(got.float(), want)
            if not err <= 2e-2:
                print(f"    {cfg}: WRONG (rms-relative {err:.2e})", flush=True)
                results.append({**row, "impl": "fused", "config": cfg.__dict__, "error": err})
                continue
            us = graph_replay_us(lambda cfg=cfg, x=x: [quant_matmul_triton(x, w, cfg) for w in weights], copies)
            mark = " (default)" if cfg == default else ""
            print(f"    fused br{cfg.block_r:<3d} split{cfg.split_k:<2d} w{cfg.num_warps}: {us:7.2f} us "
                  f"({100 * floor / us:4.1f}% of floor, {dq_us / us:4.2f}x dequant+mm){mark}", flush=True)
            results.append({**row, "impl": "fused", "config": cfg.__dict__, "default": cfg == default, "us": us,
                            "rms_rel": err})
    weights.clear()
    denses.clear()
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--only", default="", help="comma-separated shape-name prefixes to run (default: all)")
    parser.add_argument("--rows", default="1,8,16", help="comma-separated row counts of x (default: 1,8,16)")
    parser.add_argument("--qtypes", default=",".join(t.name for t in QTYPES), help="GGML types (default: Q4_K,IQ3_XXS)")
    parser.add_argument("--sweep", action="store_true", help="time a sweep of configs beside the default one")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant_linear.py needs CUDA")
    start = time.perf_counter()
    gen = np.random.default_rng(0)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    prefixes = [p for p in args.only.split(",") if p]
    rows_list = [int(n) for n in args.rows.split(",")]
    qtypes = [Q[name] for name in args.qtypes.split(",")]
    results = []
    for key in MODELS:
        for name, r, k in projection_shapes(key):
            if prefixes and not any(name.startswith(p) for p in prefixes):
                continue
            for qtype in qtypes:
                results += bench_shape(name, r, k, qtype, rows_list, args.sweep, bandwidth, gen)
    summary = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "bandwidth_gbs": bandwidth / 1e9, "rows": results,
               "seconds": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
