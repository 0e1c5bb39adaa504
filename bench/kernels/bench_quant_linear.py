"""The GGUF-quantized linear (fast/kernels/quant) at the released targets' projection shapes, each beside its floor:
the fused kernel (``quant_matmul_triton``) at N rows of x (1: decode; 8, 16, 64: verify), and the routed experts
(``quant_matmul_experts_triton``) at the 35B-A3B's decode and verify pairs.

Shapes (bench/shapes/*/config.json through the reference's expected_target_shapes; one full-attention layer,
one GDN layer and the MLP, every distinct [R, K] of at least 256 rows):

    27B      (C = 5120): q|gate [12288, C], k and v [1024, C], o [C, 6144], GDN qkv [10240, C], z [6144, C],
                         out [C, 6144], gate and up [17408, C], down [C, 17408]
    35B-A3B  (C = 2048): q|gate [8192, C], k and v [512, C], o [C, 4096], GDN qkv [8192, C], z [4096, C],
                         one expert's gate|up [1024, C] and down [C, 512], the shared expert's gate and up [512, C]
    experts  (35B-A3B):  ``35b.experts.gate_up`` [E = 256, 1024, C] and ``35b.experts.down`` [256, C, 512],
                         N rows of x routed to 8 experts each (N x 8 pairs: 8 at decode, 64 for 8 verify rows)

Per case (bf16 x): ``fused`` the kernel at its default config (``default_config``, a rule until this bench sets
it) and, with ``--sweep``, at each config of the sweep for its path (one row: the word paths' 1-4 warps and
32-128 rows a program; several rows: 32-128-row tiles of the verify dot), K split 1-8. Without
``--no-baselines``: ``dequant+mm`` the other path of quant_linear (the dequantize kernel to bf16, then cuBLAS),
whose time against the fused one's is what sets quant_linear.FUSED_MAX_ROWS; ``bf16 mm`` cuBLAS on a bf16 copy of
the weight (what an unquantized engine reads, for scale); and per shape ``dequant`` the dequantize kernel alone.
Floors: the quantized bytes read over the copy bandwidth measured here (bench/measure.copy_bandwidth) for the
products (for the experts: the chosen experts' bytes, each counted once); quantized bytes read plus bf16 bytes
written for ``dequant``. Each line prints the time, the floor and the fraction of it reached; the end prints,
per path, type and rows, the sweep's best config and its fraction beside the default's.

Each case is a CUDA graph of back-to-back calls, each on its own copy of the weight (copies enough to hold
>= 256 MiB, so nothing stays in L2 between calls, as in a step; the experts: other experts each call, from one
stacked weight of 300 MiB), replayed under triton's do_bench (bench/measure.graph_replay_us); us per call. Every
output is checked against cuBLAS on the dequantized weight (rms-relative <= 2e-2) before it is timed.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_quant_linear.py --out result.json     # from the repo root
    ... --rows 1,8,16,64 --sweep --no-baselines          # the config sweep that sets default_config
    ... --only 27b.mlp.down,35b.experts --rows 1,8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from dflash2.bench.measure import copy_bandwidth, graph_replay_us, rms_rel
from dflash2.fast.kernels.quant.dequant_triton import dequantize_triton
from dflash2.fast.kernels.quant.layout import Q, QuantWeight
from dflash2.fast.kernels.quant.quant_matmul import (QuantMatmulConfig, default_config, quant_matmul_experts_triton,
                                                     quant_matmul_triton)
from dflash2.fast.kernels.quant.random_blocks import random_blocks
from dflash2.reference.formats.config import load_target_config
from dflash2.reference.formats.weights import expected_target_shapes

MIN_BYTES = 256 << 20
SHAPES_DIR = Path(__file__).resolve().parents[1] / "shapes"
MODELS = {"27b": "qwen3.5-27b", "35b": "qwen3.5-35b-a3b"}
QTYPES = (Q.Q4_K, Q.IQ3_XXS)
SWEEP_ONE_ROW = [QuantMatmulConfig(block_r=br, split_k=s, num_warps=w)
                 for br, w in ((32, 1), (64, 2), (128, 4), (32, 4), (64, 4)) for s in (1, 2, 4, 8)]
SWEEP_ROWS = [QuantMatmulConfig(block_r=br, split_k=s, num_warps=w)
              for br, w in ((32, 4), (64, 4), (128, 8)) for s in (1, 2, 4)]


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


def expert_shapes() -> list[tuple[str, int, int, int, int]]:
    """(name, E, R, K, experts a row) of the 35B-A3B's two routed-expert products."""
    cfg = load_target_config(SHAPES_DIR / MODELS["35b"])
    e, c, i, top = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    return [("35b.experts.gate_up", e, 2 * i, c, top), ("35b.experts.down", e, c, i, top)]


def configs_for(rows: int, r: int, k: int, qtype, sweep: bool) -> tuple[QuantMatmulConfig, list[QuantMatmulConfig]]:
    default = default_config(rows, r, k, qtype)
    return default, list(dict.fromkeys([default] + ((SWEEP_ONE_ROW if rows == 1 else SWEEP_ROWS) if sweep else [])))


def line(cfg: QuantMatmulConfig, us: float, floor: float, default: QuantMatmulConfig, extra: str = "") -> str:
    mark = " (default)" if cfg == default else ""
    return (f"    fused br{cfg.block_r:<3d} split{cfg.split_k:<2d} w{cfg.num_warps}: {us:8.2f} us "
            f"(floor {floor:7.2f}, {100 * floor / us:5.1f}% of it){extra}{mark}")


def bench_shape(name, r, k, qtype, rows_list, sweep, baselines, bandwidth, gen) -> list[dict]:
    base = random_blocks(qtype, (r, k), gen, "cuda")
    qbytes = base.nbytes
    copies = max(1, -(-MIN_BYTES // qbytes))
    weights = [QuantWeight(base.data.clone(), qtype, base.shape) for _ in range(copies)]
    base_dense = dequantize_triton(base, torch.bfloat16)
    print(f"{name} {qtype.name} [{r}, {k}]: {qbytes / 2**20:.1f} MiB", flush=True)
    results = []
    floor = qbytes / bandwidth * 1e6
    if baselines:
        dense_copies = max(1, -(-MIN_BYTES // (base_dense.numel() * 2)))
        denses = [base_dense.clone() for _ in range(dense_copies)]
        scratch = torch.empty((r, k), dtype=torch.bfloat16, device="cuda")  # one buffer, as an engine would reuse
        floor_dq = (qbytes + 2 * r * k) / bandwidth * 1e6
        us = graph_replay_us(lambda: [dequantize_triton(w, torch.bfloat16, out=scratch) for w in weights], copies)
        print(f"  dequant {us:7.2f} us (floor {floor_dq:6.2f}, {100 * floor_dq / us:4.1f}%)", flush=True)
        results.append({"shape": name, "qtype": qtype.name, "r": r, "k": k, "impl": "dequant", "us": us,
                        "floor_us": floor_dq, "bytes": qbytes})
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda").bfloat16()
        want = x.float() @ base_dense.float().T
        row = {"shape": name, "qtype": qtype.name, "r": r, "k": k, "rows": rows, "floor_us": floor, "bytes": qbytes}
        extra = ""
        if baselines:
            def dequant_mm(x=x):
                for w in weights:
                    dequantize_triton(w, torch.bfloat16, out=scratch)
                    x @ scratch.T

            dq_us = graph_replay_us(dequant_mm, copies)
            bf16_us = graph_replay_us(lambda x=x: [x @ d.T for d in denses], dense_copies)
            results.append({**row, "impl": "dequant+mm", "us": dq_us})
            results.append({**row, "impl": "bf16 mm", "us": bf16_us, "floor_us": 2 * r * k / bandwidth * 1e6})
            print(f"  N={rows:<3d} dequant+mm {dq_us:7.2f} us | bf16 mm {bf16_us:7.2f} us", flush=True)
        else:
            print(f"  N={rows}", flush=True)
        default, configs = configs_for(rows, r, k, qtype, sweep)
        for cfg in configs:
            got = quant_matmul_triton(x, base, cfg)
            err = rms_rel(got.float(), want)
            if not err <= 2e-2:
                print(f"    {cfg}: WRONG (rms-relative {err:.2e})", flush=True)
                results.append({**row, "impl": "fused", "config": cfg.__dict__, "error": err})
                continue
            us = graph_replay_us(lambda cfg=cfg, x=x: [quant_matmul_triton(x, w, cfg) for w in weights], copies)
            if baselines:
                extra = f", {dq_us / us:4.2f}x dequant+mm"
            print(line(cfg, us, floor, default, extra), flush=True)
            results.append({**row, "impl": "fused", "config": cfg.__dict__, "default": cfg == default, "us": us,
                            "rms_rel": err})
    torch.cuda.empty_cache()
    return results


def bench_experts(name, e, r, k, top, qtype, rows_list, sweep, bandwidth, gen) -> list[dict]:
    """Each call routes ``rows x top`` pairs to experts drawn afresh (a row's ``top`` distinct), a different draw
    each call of the graph, so the experts' bytes come from memory, not L2; floor: the distinct experts' bytes."""
    stacked = random_blocks(qtype, (e, r, k), gen, "cuda")
    per_expert = stacked.nbytes // e
    print(f"{name} {qtype.name} [{e}, {r}, {k}]: {stacked.nbytes / 2**20:.0f} MiB, {per_expert / 2**20:.2f} MiB an "
          "expert", flush=True)
    dense = dequantize_triton(stacked, torch.bfloat16)
    results = []
    for rows in rows_list:
        draws = 16
        ids = [torch.stack([torch.randperm(e, device="cuda", generator=gen)[:top] for _ in range(rows)]).reshape(-1)
               for _ in range(draws)]
        x = torch.randn(rows * top, k, device="cuda").bfloat16()
        distinct = sum(len(torch.unique(i)) for i in ids) / draws
        floor = distinct * per_expert / bandwidth * 1e6
        want = torch.stack([x[p].float() @ dense[int(ids[0][p])].float().T for p in range(x.shape[0])])
        row = {"shape": name, "qtype": qtype.name, "e": e, "r": r, "k": k, "rows": rows, "pairs": rows * top,
               "floor_us": floor, "bytes": distinct * per_expert}
        print(f"  N={rows:<3d} ({rows * top} pairs, {distinct:.1f} experts a call)", flush=True)
        default, configs = configs_for(1, r, k, qtype, sweep)
        for cfg in [None] + configs:
            got = quant_matmul_experts_triton(x, stacked, ids[0], cfg)
            err = rms_rel(got.float(), want)
            shown = cfg or QuantMatmulConfig(-1, -1, -1)  # None: the launcher's own choice (its split counts pairs)
            if not err <= 2e-2:
                print(f"    {shown}: WRONG (rms-relative {err:.2e})", flush=True)
                results.append({**row, "impl": "experts", "config": shown.__dict__, "error": err})
                continue
            us = graph_replay_us(lambda cfg=cfg: [quant_matmul_experts_triton(x, stacked, i, cfg) for i in ids], draws)
            text = line(shown, us, floor, default)
            print(text.replace("br-1  split-1 w-1", "launcher default") if cfg is None else text, flush=True)
            results.append({**row, "impl": "experts", "config": None if cfg is None else cfg.__dict__,
                            "default": cfg is None, "us": us, "rms_rel": err})
    del dense
    torch.cuda.empty_cache()
    return results


def summary(results: list[dict]) -> None:
    """Per (shape, type, rows): the best config's fraction of the floor beside the default's."""
    groups: dict[tuple, list[dict]] = {}
    for res in results:
        if res["impl"] in ("fused", "experts") and "us" in res:
            groups.setdefault((res["shape"], res["qtype"], res["rows"]), []).append(res)
    print("\nbest of the sweep vs the default (fraction of the bytes floor):")
    for (shape, qtype, rows), group in groups.items():
        best = min(group, key=lambda res: res["us"])
        default = next((res for res in group if res.get("default")), best)
        print(f"  {shape:24s} {qtype:8s} N={rows:<3d} default {100 * default['floor_us'] / default['us']:5.1f}% | "
              f"best {100 * best['floor_us'] / best['us']:5.1f}% {best['config']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--only", default="", help="comma-separated shape-name prefixes to run (default: all)")
    parser.add_argument("--rows", default="1,8,16", help="comma-separated row counts of x (default: 1,8,16)")
    parser.add_argument("--qtypes", default=",".join(t.name for t in QTYPES), help="GGML types (default: Q4_K,IQ3_XXS)")
    parser.add_argument("--sweep", action="store_true", help="time a sweep of configs beside the default one")
    parser.add_argument("--no-baselines", action="store_true", help="skip dequant, dequant+mm and bf16 mm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant_linear.py needs CUDA")
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    prefixes = [p for p in args.only.split(",") if p]
    rows_list = [int(n) for n in args.rows.split(",")]
    qtypes = [Q[name] for name in args.qtypes.split(",")]
    chosen = lambda name: not prefixes or any(name.startswith(p) for p in prefixes)  # noqa: E731
    results = []
    for key in MODELS:
        for name, r, k in projection_shapes(key):
            if chosen(name):
                for qtype in qtypes:
                    results += bench_shape(name, r, k, qtype, rows_list, args.sweep, not args.no_baselines,
                                           bandwidth, gen)
    for name, e, r, k, top in expert_shapes():
        if chosen(name):
            for qtype in qtypes:
                results += bench_experts(name, e, r, k, top, qtype, rows_list, args.sweep, bandwidth, gen)
    summary(results)
    record = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "bandwidth_gbs": bandwidth / 1e9, "rows": results,
              "seconds": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
