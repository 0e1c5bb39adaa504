"""Paged-attention benchmark: the split-KV Triton kernel (fast/kernels/attention/paged_attention.py) against the
torch twin (fast/kernels/attention/paged_attention.paged_attention_torch, a gather of each whole context) at
the released targets' attention shapes, beside the floor.

    Qwen3.5-27B:      H = 24, Hkv = 4, D = 256        Qwen3.5-35B-A3B: H = 16, Hkv = 2, D = 256
    bf16 K/V in 16-slot pages scattered over the cache; B in {1, 4, 16}; Tq in {1, 8} rows per
    sequence (decode, a k = 7 verify); contexts 512 and 4096 (ragged: sequence b has 5 * (b % 4)
    keys fewer, so most end mid-page), plus two 32k shapes
    floor = sum_b context_b * Hkv * D * 2 (K and V) * 2 bytes / bandwidth   (B = 1, 4096, Hkv = 2: 8 MiB)

Every slot outside the contexts holds NaN, so a read past a context shows as a non-finite output.
Checks per shape: the kernel within bf16 NUMERIC (2e-2 rms-relative) of the torch form, and both
against the torch form in fp32 on the same (bf16-valued) inputs; two eager kernel calls bitwise
equal; a CUDA graph of the kernel (captured once, replayed) bitwise equal to eager. Times (do_bench,
median, L2 flushed before every repetition): the kernel's graph replay (what a captured decode step
pays), the kernel called eagerly (adds Python launch cost), the torch form's graph replay. A short
sweep of ``split_len`` (a runtime argument: no recompile) follows at four shapes; ``--sweep`` adds
``block_n`` x ``num_warps`` there. Bandwidth: the nominal 4.25e12 B/s and a device-to-device copy
measured here (read + write).

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_paged_attention.py --out result.json   # from the repo root
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from triton.testing import do_bench

from dflash2.fast.kernels.attention.paged_attention import launch_plan, paged_attention_triton
from dflash2.fast.kernels.attention.paged_attention import paged_attention_torch
from dflash2.fast.model.batch import ForwardBatch
from dflash2.fast.model.pools import CachePools
from dflash2.fast.model.step import StepMeta
from dflash2.reference.tiny.target import tiny_target_config
from dflash2.bench.measure import copy_bandwidth, rms_rel

MODELS = {"27b": (24, 4, 256), "35b-a3b": (16, 2, 256)}  # H, Hkv, D
PAGE_SIZE = 16
NOMINAL_BW = 4.25e12
BF16_BOUND = 2e-2
SHAPES = [(model, batch, rows, context) for model in MODELS for context in (512, 4096) for batch in (1, 4, 16)
          for rows in (1, 8)] + [("35b-a3b", 1, 8, 32768), ("27b", 4, 1, 32768)]
SWEEP_SHAPES = [("35b-a3b", 1, 1, 4096), ("27b", 1, 8, 4096), ("27b", 16, 8, 4096), ("35b-a3b", 4, 1, 512)]


def bench(fn) -> float:
    """Median microseconds per call (L2 flushed before each)."""
    return 1e3 * do_bench(fn, warmup=5, rep=20, return_mode="median")


def make_step(model: str, batch: int, rows: int, context: int, gen: torch.Generator):
    """q, the NaN-poisoned caches, the step's StepMeta and the K/V bytes it must read."""
    heads, kv_heads, dim = MODELS[model]
    contexts = [context - 5 * (b % 4) for b in range(batch)]
    pages_per_seq = -(-context // PAGE_SIZE)
    width = triton.next_power_of_2(pages_per_seq)  # the CUDA graphs' page-table bucket
    num_pages = batch * pages_per_seq + 8
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.full((batch, width), -1, dtype=torch.int32)
    tables[:, :pages_per_seq] = order[:batch * pages_per_seq].view(batch, pages_per_seq).to(torch.int32)
    num_slots = num_pages * PAGE_SIZE
    t = torch.arange(pages_per_seq * PAGE_SIZE)
    slots = tables[:, :pages_per_seq].long()[:, t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE  # [B, ctx]
    valid = t[None, :] < torch.tensor(contexts)[:, None]
    written = torch.zeros(num_slots + 1, dtype=torch.bool)
    written[slots[valid]] = True
    written = written.cuda()
    caches = []
    for _ in range(2):
        cache = torch.randn(num_slots + 1, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        caches.append(cache.masked_fill_(~written[:, None, None], float("nan")))
    positions = torch.cat([torch.arange(c - rows, c) for c in contexts])
    row_slots = torch.cat([slots[b, c - rows:c] for b, c in enumerate(contexts)])
    step = ForwardBatch(
        token_ids=torch.zeros(batch * rows, dtype=torch.long, device="cuda"), positions=positions.cuda(),
        cu_seqlens=(torch.arange(batch + 1) * rows).to(torch.int32).cuda(),
        state_slots=torch.arange(batch, device="cuda"), kv_slot_mapping=row_slots.cuda(), block_tables=tables.cuda(),
        context_lens=torch.tensor(contexts, device="cuda"), is_verify=rows > 1,
        logits_rows=torch.arange(batch * rows, device="cuda"), max_query_len=rows)
    pools = CachePools(tiny_target_config("tiny-dense"), num_pages, PAGE_SIZE, num_slots=batch, max_verify_rows=rows,
                       dtype=torch.bfloat16, device="cuda", mtp=False)
    meta = StepMeta.build(step, pools)
    q = torch.randn(batch * rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = sum(contexts) * kv_heads * dim * 2 * 2
    return q, caches[0], caches[1], meta, kv_bytes


def graph_of(fn):
    """``fn`` captured once in a CUDA graph: (graph, its output)."""
    fn()  # compile and warm the allocator outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def run_shape(model: str, batch: int, rows: int, context: int, gen: torch.Generator, bw: float) -> dict:
    q, k, v, meta, kv_bytes = make_step(model, batch, rows, context, gen)
    kernel = lambda: paged_attention_triton(q, k, v, meta)  # noqa: E731
    eager = kernel()
    again = kernel()
    ref_bf16 = paged_attention_torch(q, k, v, meta)
    ref_fp32 = paged_attention_torch(q.float(), k.float(), v.float(), meta)
    graph, captured = graph_of(kernel)
    graph.replay()
    torch_graph, _ = graph_of(lambda: paged_attention_torch(q, k, v, meta))
    torch.cuda.synchronize()
    heads, kv_heads, dim = MODELS[model]
    plan = launch_plan(batch, heads, kv_heads, dim, rows, meta.block_tables.shape[1] * PAGE_SIZE, q.device)
    row = {"model": model, "batch": batch, "rows": rows, "context": context, "kv_bytes": kv_bytes,
           "split_len": plan.split_len, "num_splits": plan.num_splits, "block_n": plan.block_n,
           "num_warps": plan.num_warps,
           "finite": bool(torch.isfinite(eager).all()),
           "err_vs_torch": rms_rel(eager.float(), ref_bf16.float()),
           "err_vs_fp32": rms_rel(eager.float(), ref_fp32), "torch_err_vs_fp32": rms_rel(ref_bf16.float(), ref_fp32),
           "deterministic": bool(torch.equal(eager, again)), "graph_equal": bool(torch.equal(captured, eager)),
           "graph_us": bench(graph.replay), "eager_us": bench(kernel), "torch_graph_us": bench(torch_graph.replay),
           "floor_us": kv_bytes / bw * 1e6, "floor_nominal_us": kv_bytes / NOMINAL_BW * 1e6}
    row["fraction_of_floor"] = row["floor_us"] / row["graph_us"]
    row["ok"] = (row["finite"] and row["err_vs_torch"] <= BF16_BOUND and row["err_vs_fp32"] <= BF16_BOUND
                 and row["deterministic"] and row["graph_equal"])
    del graph, torch_graph
    return row


def run_sweep(model: str, batch: int, rows: int, context: int, gen: torch.Generator, bw: float,
              wide: bool) -> list[dict]:
    q, k, v, meta, kv_bytes = make_step(model, batch, rows, context, gen)
    ref = paged_attention_torch(q, k, v, meta)
    heads, kv_heads, dim = MODELS[model]
    max_context = meta.block_tables.shape[1] * PAGE_SIZE
    default = launch_plan(batch, heads, kv_heads, dim, rows, max_context, q.device)
    splits = sorted(s for s in {32, 64, 128, 256, 512, 1024, 4096, max_context}
                    if s <= max_context and s % default.block_n == 0)  # max_context itself: one split, no merge
    configs = [dict(split_len=s) for s in splits]
    if wide:  # every tile x warps pair at the splits a verify tile can use (none shorter than block_n)
        configs += [dict(split_len=s, block_n=bn, num_warps=w) for s in (64, 128, 256) for bn in (16, 32, 64)
                    for w in (4, 8) if s >= bn and s <= max_context]
    out = []
    for cfg in configs:
        fn = lambda: paged_attention_triton(q, k, v, meta, **cfg)  # noqa: E731
        graph, captured = graph_of(fn)
        graph.replay()
        torch.cuda.synchronize()
        us = bench(graph.replay)
        out.append({"model": model, "batch": batch, "rows": rows, "context": context, **cfg, "graph_us": us,
                    "fraction_of_floor": kv_bytes / bw * 1e6 / us, "err_vs_torch": rms_rel(captured.float(),
                                                                                          ref.float())})
        del graph
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep split_len x block_n x num_warps (more compiles)")
    parser.add_argument("--sweep-shapes", default=None,
                        help="model:batch:rows:context,... to sweep instead of the default four")
    parser.add_argument("--sweep-only", action="store_true", help="skip the table of shapes; sweep only")
    args = parser.parse_args()
    sweep_shapes = SWEEP_SHAPES if args.sweep_shapes is None else [
        (m, int(b), int(r), int(c)) for m, b, r, c in (spec.split(":") for spec in args.sweep_shapes.split(","))]
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    for shape in [] if args.sweep_only else SHAPES:
        rows.append(run_shape(*shape, gen, bw))
        torch.cuda.empty_cache()
    sweep = [r for shape in sweep_shapes for r in run_sweep(*shape, gen, bw, args.sweep)]
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_bandwidth": bw, "nominal_bandwidth": NOMINAL_BW,
              "page_size": PAGE_SIZE, "shapes": rows, "sweep": sweep,
              "all_ok": all(r["ok"] for r in rows) and all(r["err_vs_torch"] <= BF16_BOUND for r in sweep),
              "seconds": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    print("split_len sweep (graph replay us, fraction of floor):")
    for r in sweep:
        knobs = " ".join(f"{key}={r[key]}" for key in ("split_len", "block_n", "num_warps") if key in r)
        print(f"  {r['model']:8s} B={r['batch']:2d} Tq={r['rows']} ctx={r['context']:5d} {knobs:28s} "
              f"{r['graph_us']:8.2f} us  {100 * r['fraction_of_floor']:5.1f}%")
    print(f"\n{result['device']}, copy bandwidth {bw / 1e12:.2f} TB/s (nominal {NOMINAL_BW / 1e12:.2f}); "
          f"{result['seconds']:.1f} s; all checks {'pass' if result['all_ok'] else 'FAIL'}")
    print(f"{'model':8s} {'B':>3s} {'Tq':>3s} {'ctx':>6s} {'splits':>6s} {'floor us':>8s} {'graph us':>8s} "
          f"{'%floor':>6s} {'eager us':>8s} {'torch us':>9s} {'speedup':>7s} {'err':>8s} ok")
    for r in rows:
        print(f"{r['model']:8s} {r['batch']:3d} {r['rows']:3d} {r['context']:6d} {r['num_splits']:6d} "
              f"{r['floor_us']:8.2f} {r['graph_us']:8.2f} {100 * r['fraction_of_floor']:6.1f} {r['eager_us']:8.2f} "
              f"{r['torch_graph_us']:9.2f} {r['torch_graph_us'] / r['graph_us']:7.1f} {r['err_vs_torch']:8.1e} "
              f"{'yes' if r['ok'] else 'NO'}")


if __name__ == "__main__":
    main()
