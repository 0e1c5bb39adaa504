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

``--prefill`` benchmarks the prefill (flash-attention) kernel instead: chunks of 512 and 2048 rows (``--rows``)
ending at contexts of 2048, 4096 and 16384 keys (``--contexts``; a chunk of as many rows as its context starts
at 0), one sequence at each model's shape plus a chunk of four 512-row sequences, beside the FLOPs floor:

    floor = 4 * H * D * sum_n visible(n) / the bf16 matmul rate measured here (an 8192^3 cuBLAS GEMM)
    (visible(n) = keys row n sees; 2048 rows at 4096, 35B-A3B: 4 * 16 * 256 * 6.3e6 = 0.10 TFLOP)

Times (do_bench median, L2 flushed): the kernel's CUDA-graph replay (device time: an eager prefill forward
launches ahead of the GPU, so its Python launch cost hides) and its eager call, the torch twin's eager call.
The twin runs where its scores (``B * H * Tq * Tctx`` fp32, about four such buffers live at once) fit in a
quarter of the free memory; the checks are the kernel within bf16 NUMERIC of the twin and of an fp32 reference
(the twin in fp32, or where that does not fit, the kernel on fp32 inputs), finite, two calls bitwise equal and
the graph's replay equal to them. ``--sweep`` adds a sweep
of block_m x block_n x num_warps x num_stages (and one head per tile) at ``--sweep-shapes``
(model:batch:rows:context, default 2048 rows at 4096 on both models); a config that does not compile (shared
memory) is recorded with its error.

    PYTHONPATH=/tmp/pkg python3 bench/kernels/bench_paged_attention.py --prefill --sweep --out prefill.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from triton.testing import do_bench

from dflash2.fast.kernels.attention.paged_attention import launch_plan, paged_attention_triton, prefill_plan
from dflash2.fast.kernels.attention.paged_attention import paged_attention_prefill, paged_attention_torch
from dflash2.fast.model.batch import ForwardBatch
from dflash2.fast.model.pools import CachePools
from dflash2.fast.model.step import StepMeta
from dflash2.reference.tiny.target import tiny_target_config
from dflash2.bench.measure import copy_bandwidth, matmul_rate, rms_rel

MODELS = {"27b": (24, 4, 256), "35b-a3b": (16, 2, 256)}  # H, Hkv, D
PAGE_SIZE = 16
NOMINAL_BW = 4.25e12
BF16_BOUND = 2e-2
SHAPES = [(model, batch, rows, context) for model in MODELS for context in (512, 4096) for batch in (1, 4, 16)
          for rows in (1, 8)] + [("35b-a3b", 1, 8, 32768), ("27b", 4, 1, 32768)]
SWEEP_SHAPES = [("35b-a3b", 1, 1, 4096), ("27b", 1, 8, 4096), ("27b", 16, 8, 4096), ("35b-a3b", 4, 1, 512)]
PREFILL_ROWS = (512, 2048)
PREFILL_CONTEXTS = (2048, 4096, 16384)
PREFILL_SWEEP_SHAPES = [("35b-a3b", 1, 2048, 4096), ("27b", 1, 2048, 4096)]
PREFILL_SWEEP = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                 for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for st in (1, 2, 3)]


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


def prefill_kernel(q, k, v, meta, **tiles):
    """The prefill kernel on a step (what the dispatch runs for a chunk of more than 16 rows per sequence)."""
    return paged_attention_prefill(q, k, v, meta.block_tables, meta.context_lens, meta.cu_seqlens, meta.positions,
                                   max_query_len=meta.max_query_len, page_size=meta.page_size, **tiles)


def prefill_flops(model: str, meta) -> float:
    """4 * H * D * sum_n visible(n): QK^T and PV over the keys each row sees (positions below the context)."""
    heads, _, dim = MODELS[model]
    return 4.0 * heads * dim * float((meta.positions + 1).sum())


def twin_fits(model: str, batch: int, rows: int, meta, dtype_factor: float = 1.0) -> bool:
    """Whether the torch twin's scores (four fp32 ``[B, H, Tq, Tctx]`` buffers live at once) fit in a quarter
    of the free memory (``dtype_factor`` 1.5 for the fp32 twin's larger operands)."""
    heads = MODELS[model][0]
    scores = batch * heads * rows * meta.block_tables.shape[1] * PAGE_SIZE * 4
    return 4 * scores * dtype_factor < torch.cuda.mem_get_info()[0] / 4


def fp32_reference(model: str, batch: int, rows: int, q, k, v, meta):
    """(the output in fp32 on the same bf16-valued inputs, by the twin where it fits or else the kernel, its name)."""
    if twin_fits(model, batch, rows, meta, 1.5):
        return paged_attention_torch(q.float(), k.float(), v.float(), meta), "twin fp32"
    return prefill_kernel(q.float(), k.float(), v.float(), meta), "kernel fp32"


def run_prefill_shape(model: str, batch: int, rows: int, context: int, gen: torch.Generator, rate: float) -> dict:
    q, k, v, meta, kv_bytes = make_step(model, batch, rows, context, gen)
    heads, kv_heads, dim = MODELS[model]
    kernel = lambda: prefill_kernel(q, k, v, meta)  # noqa: E731
    out = kernel()
    again = kernel()
    graph, captured = graph_of(kernel)
    graph.replay()
    twin = twin_fits(model, batch, rows, meta)
    reference, reference_name = fp32_reference(model, batch, rows, q, k, v, meta)
    ref_bf16 = paged_attention_torch(q, k, v, meta) if twin else None
    torch.cuda.synchronize()
    plan = prefill_plan(batch, heads, kv_heads, dim, rows, q.element_size(), q.device)
    flops = prefill_flops(model, meta)
    row = {"model": model, "batch": batch, "rows": rows, "context": context, "flops": flops, "kv_bytes": kv_bytes,
           "block_m": plan.block_m, "block_n": plan.block_n, "heads_per_program": plan.heads_per_program,
           "num_warps": plan.num_warps, "num_stages": plan.num_stages,
           "finite": bool(torch.isfinite(out).all()), "deterministic": bool(torch.equal(out, again)),
           "graph_equal": bool(torch.equal(captured, out)),
           "reference": reference_name, "err_vs_fp32": rms_rel(out.float(), reference.float()),
           "err_vs_torch": rms_rel(out.float(), ref_bf16.float()) if twin else None,
           "kernel_us": bench(graph.replay), "eager_us": bench(kernel),
           "torch_us": bench(lambda: paged_attention_torch(q, k, v, meta)) if twin else None,
           "floor_us": flops / rate * 1e6}
    row["fraction_of_floor"] = row["floor_us"] / row["kernel_us"]
    row["tflops"] = flops / row["kernel_us"] / 1e6
    row["ok"] = (row["finite"] and row["deterministic"] and row["graph_equal"] and row["err_vs_fp32"] <= BF16_BOUND
                 and (row["err_vs_torch"] is None or row["err_vs_torch"] <= BF16_BOUND))
    del graph, reference, ref_bf16
    return row


def run_prefill_sweep(model: str, batch: int, rows: int, context: int, gen: torch.Generator,
                      rate: float) -> list[dict]:
    q, k, v, meta, _ = make_step(model, batch, rows, context, gen)
    ref, _ = fp32_reference(model, batch, rows, q, k, v, meta)
    flops = prefill_flops(model, meta)
    configs = PREFILL_SWEEP + [dict(heads_per_program=1)]  # one head per tile at the default tiles
    out = []
    for cfg in configs:
        row = {"model": model, "batch": batch, "rows": rows, "context": context, **cfg}
        try:
            graph, got = graph_of(lambda: prefill_kernel(q, k, v, meta, **cfg))  # noqa: B023 (called here)
            graph.replay()
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 (a tile that does not compile: out of shared memory)
            out.append({**row, "error": f"{type(error).__name__}: {str(error)[:200]}"})
            continue
        us = bench(graph.replay)
        out.append({**row, "kernel_us": us, "fraction_of_floor": flops / rate * 1e6 / us,
                    "err_vs_fp32": rms_rel(got.float(), ref.float())})
        del graph
    return out


def parse_shapes(spec: str | None, default):
    """``--sweep-shapes`` (``model:batch:rows:context,...``) as tuples, or ``default``."""
    if spec is None:
        return default
    return [(m, int(b), int(r), int(c)) for m, b, r, c in (item.split(":") for item in spec.split(","))]


def main_prefill(args) -> None:
    rows_list = tuple(int(n) for n in args.rows.split(",")) if args.rows else PREFILL_ROWS
    contexts = tuple(int(n) for n in args.contexts.split(",")) if args.contexts else PREFILL_CONTEXTS
    shapes = [(model, 1, rows, context) for model in MODELS for rows in rows_list for context in contexts
              if rows <= context] + [("35b-a3b", 4, 512, 4096)]
    sweep_shapes = parse_shapes(args.sweep_shapes, PREFILL_SWEEP_SHAPES)
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rate = matmul_rate()
    table = []
    for shape in [] if args.sweep_only else shapes:
        table.append(run_prefill_shape(*shape, gen, rate))
        torch.cuda.empty_cache()
    sweep = [r for shape in sweep_shapes for r in run_prefill_sweep(*shape, gen, rate)] if args.sweep else []
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "matmul_rate_bf16": rate, "page_size": PAGE_SIZE, "prefill": table,
              "sweep": sweep, "all_ok": all(r["ok"] for r in table) and all(
                  r["err_vs_fp32"] <= BF16_BOUND for r in sweep if "error" not in r),
              "seconds": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    if sweep:
        print("prefill config sweep (graph replay us, fraction of the FLOPs floor):")
        for r in sweep:
            knobs = " ".join(f"{key}={r[key]}" for key in ("block_m", "block_n", "heads_per_program", "num_warps",
                                                             "num_stages") if key in r)
            timing = r["error"] if "error" in r else f"{r['kernel_us']:9.1f} us  {100 * r['fraction_of_floor']:5.1f}%"
            print(f"  {r['model']:8s} B={r['batch']} Tq={r['rows']:5d} ctx={r['context']:6d} {knobs:58s} {timing}")
    print(f"\n{result['device']}, bf16 matmul {rate / 1e12:.0f} TFLOP/s; {result['seconds']:.1f} s; "
          f"all checks {'pass' if result['all_ok'] else 'FAIL'}")
    print(f"{'model':8s} {'B':>2s} {'Tq':>5s} {'ctx':>6s} {'tiles':>14s} {'GFLOP':>7s} {'floor us':>9s} "
          f"{'graph us':>9s} {'%floor':>6s} {'TFLOP/s':>7s} {'eager us':>9s} {'torch us':>9s} {'speedup':>7s} "
          f"{'err':>8s} ok")
    for r in table:
        tiles = f"{r['block_m']}x{r['block_n']}/{r['heads_per_program']}h/{r['num_warps']}w"
        torch_us = f"{r['torch_us']:9.1f}" if r["torch_us"] is not None else f"{'-':>9s}"
        speedup = f"{r['torch_us'] / r['kernel_us']:7.1f}" if r["torch_us"] is not None else f"{'-':>7s}"
        print(f"{r['model']:8s} {r['batch']:2d} {r['rows']:5d} {r['context']:6d} {tiles:>14s} {r['flops'] / 1e9:7.1f} "
              f"{r['floor_us']:9.1f} {r['kernel_us']:9.1f} {100 * r['fraction_of_floor']:6.1f} {r['tflops']:7.1f} "
              f"{r['eager_us']:9.1f} {torch_us} {speedup} {r['err_vs_fp32']:8.1e} {'yes' if r['ok'] else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep split_len x block_n x num_warps (with --prefill: the prefill tiles; more "
                             "compiles)")
    parser.add_argument("--sweep-shapes", default=None,
                        help="model:batch:rows:context,... to sweep instead of the default four")
    parser.add_argument("--sweep-only", action="store_true", help="skip the table of shapes; sweep only")
    parser.add_argument("--prefill", action="store_true",
                        help="the prefill kernel on long chunks against the torch twin and the FLOPs floor")
    parser.add_argument("--rows", default=None, help="--prefill: chunk rows, e.g. 512,2048 (the default)")
    parser.add_argument("--contexts", default=None, help="--prefill: contexts, e.g. 2048,4096,16384 (the default)")
    args = parser.parse_args()
    if args.prefill:
        main_prefill(args)
        return
    sweep_shapes = parse_shapes(args.sweep_shapes, SWEEP_SHAPES)
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
