"""``ft bench`` output: ``bench.json`` (every figure), ``bench.md`` (the table, with the command) and
``acceptance.png`` (acceptance by draft position per speculative setting), in one results folder."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def step_ratios(runs: list[dict]) -> list[tuple[dict, dict, float]]:
    """Each speculative run beside the plain-decode run at its concurrency and prompt length that ran
    last before it (runs of one process side by side, the issue's "one verify step / one decode step"):
    ``(run, off_run, verify_ms / decode_ms)`` for each speculative run that has one."""
    pairs, last_off = [], {}
    for r in runs:
        if "error" in r or r.get("step_ms_median") is None:
            continue
        key = (r["concurrency"], r["prompt_len"])
        if r["algorithm"] == "none":
            last_off[key] = r
        elif key in last_off:
            pairs.append((r, last_off[key], r["step_ms_median"] / last_off[key]["step_ms_median"]))
    return pairs


def _speedup(run: dict, off: dict) -> str:
    """Output tokens per second of ``run`` over the plain run's, e.g. ``1.42x``."""
    if not run.get("tokens_per_s") or not off.get("tokens_per_s"):
        return "-"
    return f"{run['tokens_per_s'] / off['tokens_per_s']:.2f}x"


def ratio_medians(pairs: list[tuple[dict, dict, float]]) -> list[tuple[tuple, list[float], float]]:
    """The pairs of :func:`step_ratios` grouped by (setting, concurrency, prompt length), in first-seen order:
    ``(key, ratios, median)`` for each group of two or more (repeated runs, e.g. five off/dflash7 pairs in one
    ``--runs``); the median of an even count is the mean of the middle two."""
    groups: dict[tuple, list[float]] = {}
    for r, _, ratio in pairs:
        groups.setdefault((r["setting"], r["concurrency"], r["prompt_len"]), []).append(ratio)
    return [(key, ratios, statistics.median(ratios)) for key, ratios in groups.items() if len(ratios) >= 2]


def allreduce_line(result: dict) -> str | None:
    """The all-reduce bandwidth ``--tp`` > 1 measured (bench/allreduce.py), for the header beside the copy bandwidth:
    bus and algorithm bandwidth at 16 MiB, then the bus bandwidth at each message size the steps move; None at tp=1
    (and in results written before tensor parallelism)."""
    measured = result.get("allreduce")
    if not measured:
        return None
    n = measured["tp"]
    sizes = {m["bytes"]: m for m in measured["sizes"]}
    peak = sizes.get(measured["peak_bytes"])
    head = (f"- all-reduce over tp={n} ranks measured in this run ({measured['backend']}, {measured['dtype']}, "
            f"{n} processes spawned before the engines; bus = algorithm x 2(N-1)/N = x {2 * (n - 1) / n:.2f})")
    if peak is not None:
        head += f": 16 MiB {peak['busbw_GBps']:.1f} GB/s bus, {peak['algbw_GBps']:.1f} GB/s algorithm"
    steps = [m for size, m in sorted(sizes.items()) if size != measured["peak_bytes"]]
    if steps:
        head += "; at the steps' message sizes (bus GB/s, us a call): " + ", ".join(
            f"{_size(m['bytes'])} {m['busbw_GBps']:.3g} ({m['us']:.0f} us)" for m in steps)
    return head


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.3g} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.3g} KiB"


def markdown(result: dict) -> str:
    sim = result.get("simulated_tokens_per_step")
    lines = [
        f"# ft bench: {result['model']} ({result['load_format']} weights"
        f"{', matrices as GGUF ' + result['dummy_weight_type'] if result.get('dummy_weight_type') else ''})",
        "",
        f"- date {result['date']}, device {result['device']}, torch {result['torch']}, "
        f"git HEAD as the run saw it {result['git']} (a copied checkout may carry a stale one)",
        f"- copy bandwidth measured in this run: {result['copy_bandwidth_GBps']:.0f} GB/s (read + write)",
        *filter(None, [allreduce_line(result)]),
        f"- bf16 matmul rate measured in this run: {_fmt(result.get('bf16_matmul_TFLOPs'), '.0f')} TFLOP/s "
        "(8192^3 GEMM, CUDA events, median; - off CUDA)",
        f"- shape: hidden {result['shape']['hidden_size']}, {result['shape']['num_hidden_layers']} layers, "
        f"V = {result['shape']['vocab_size']}, {'MoE' if result['shape']['is_moe'] else 'dense'}",
        f"- command: `{result['command']}`",
    ]
    sampled = {(r.get("temperature", 0.0), r.get("top_p", 1.0)) for r in result["runs"]}
    lines.append("- sampling: " + ", ".join("greedy" if t == 0 else f"temperature {t}, top-p {p}, seed i for request i"
                                            for t, p in sorted(sampled)))
    if sim == "seed":
        lines.append("- **simulated acceptance (timing only)**: each verify keeps drafts so that the mean is the "
                     "seed's own committed tokens per step for its setting and target family (the tok/step column); "
                     "random weights accept nothing on their own")
    elif sim is not None:
        lines.append(f"- **simulated acceptance (timing only)**: each verify keeps drafts so that the mean is "
                     f"{sim} committed tokens per step; random weights accept nothing on their own")
    lines += ["", "Step: median host wall time of the decode (off) or verify step, each ending on its one "
              "device read; floor: the bytes the step must move over the measured bandwidth (bench/floors.py); "
              "under tp > 1 one rank's: bytes floor (its shard of the weights and caches, the draft or MTP head whole "
              "on rank 0) over the copy bandwidth + all-reduce floor (the step's ring bus bytes of its 2 L + 1 "
              "all-reduces and its logits' all-gather, over the bus bandwidth measured at their sizes; 0 at tp=1). "
              "wall tok/s: every token of the timed generate (prefill included) over its wall time, the median of "
              f"{result['runs'][0].get('repeats', 1) if result['runs'] else 1} generate(s).",
              "", "Prefill: the timed generate's prefill calls with the prefix cache empty, so every prompt token is "
              "prefilled (conc x prompt tokens), at most max_num_batched_tokens rows a call, several prompts in one "
              "call where they fit (`off:1:4096` is one 4,096-token prompt in two 2,048-row calls by default); "
              "prefill s: their summed wall time per generate, each call from a synchronized device to the end "
              "of its own device work (a speculative row's includes its proposer's pass over the prompt); prefill "
              "tok/s: the rows over that time; prefill floor: the target's FLOPs for those rows "
              "(bench/floors.prefill_flops: its weights, top-k experts only, the LM head for each prompt's last row, "
              "causal attention, the GDN recurrence; no draft work) over the measured bf16 matmul rate, as a "
              "fraction of prefill s.",
              "", "| setting | conc | prompt | step | tp | step ms | floor ms | bytes floor | all-reduce floor | "
              "floor/step | draft ms | tok/step | tok/s | wall tok/s | prefill s | prefill tok/s | prefill floor "
              "| KV tokens | draft params | ring+window MiB/slot | workspace MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['setting']} | {r['concurrency']} | {r['prompt_len']} | FAILED: {r['error'][:120]} |")
            continue
        slot_mib = (r["ring_bytes_per_slot"] + r["window_bytes_per_slot"]) / 2**20
        lines.append(
            f"| {r['setting']} | {r['concurrency']} | {r['prompt_len']} | {r['step']} | {r.get('tp', 1)} "
            f"| {_fmt(r['step_ms_median'], '.2f')} | {r['floor_ms']:.2f} "
            f"| {r.get('floor_bytes_ms', r['floor_ms']):.2f} | {r.get('floor_allreduce_ms', 0.0):.2f} "  # older: tp=1
            f"| {_fmt(r['floor_fraction'], '.0%')} | {_fmt(r.get('draft_ms'), '.2f')} "
            f"| {_fmt(r['tokens_per_step'], '.2f')} | {_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r.get('wall_tokens_per_s'), '.1f')} | {r['prefill_s']:.2f} "
            f"| {_fmt(r.get('prefill_tokens_per_s'), '.0f')} | {_fmt(r.get('prefill_floor_fraction'), '.0%')} "
            f"| {r['kv_tokens']} | {r['draft_params'] / 1e6:.0f}M | {slot_mib:.0f} "
            f"| {r.get('workspace_bytes', 0) / 2**20:.0f} |")
    pairs = step_ratios(result["runs"])
    if pairs:
        lines += ["", "One speculative step over one decode step, and output tokens per second over plain decoding's "
                  "(each beside the off run at its concurrency and prompt that ran last before it):", ""]
        lines += [f"- {r['setting']} c={r['concurrency']} p={r['prompt_len']}: {r['step_ms_median']:.2f} / "
                  f"{off['step_ms_median']:.2f} ms = {ratio:.3f}; tok/s {_speedup(r, off)}" for r, off, ratio in pairs]
        lines += [f"- **{setting} c={conc} p={prompt}: median of {len(ratios)} pairs {median:.3f}** "
                  f"({min(ratios):.3f}-{max(ratios):.3f})" for (setting, conc, prompt), ratios, median
                  in ratio_medians(pairs)]
    for r in result["runs"]:
        prof = r.get("profile") if "error" not in r else None
        if prof:
            lines += ["", f"Profile of a 17-token generate from 8-token prompts at the run's sampling (mostly decode/verify steps), {r['setting']} c={r['concurrency']} p={r['prompt_len']}: "
                      f"{prof['total_gpu_ms']:.1f} ms of GPU time", "", "| kernel | calls | GPU ms | share |",
                      "|---|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['calls']} | {k['gpu_ms']:.2f} | {k['share']:.1%} |" for k in prof["kernels"]]
    budgets = [r for r in result["runs"] if "error" not in r and r.get("kv_tokens_budget") is not None]
    if budgets:
        lines += ["", "KV tokens the cache budget holds (before the cap of concurrency x max_model_len), the "
                  "activations kept out of it (a profiling forward of the largest prefill chunk; CUDA graph pools), and "
                  "the seed's engine at this shape on its 80 GB card (max_running_req 4, default memory settings):", ""]
        lines += [f"- {r['setting']} c={r['concurrency']}: {r['kv_tokens_budget']:,} KV tokens"
                  + (f" (the seed's {r['seed_kv_tokens']:,}: {r['kv_tokens_budget'] / r['seed_kv_tokens']:.2f}x)"
                     if r.get("seed_kv_tokens") else "")
                  + f"; activations {r.get('activation_bytes', 0) / 2**20:.0f} MiB, graph pools "
                    f"{r.get('graph_pool_bytes', 0) / 2**20:.0f} MiB" for r in budgets]
    if result.get("verify_kernel_us"):
        lines += ["", "Sparse-q verify with target probabilities (top-k 20, top-p 0.95, T = 1, V = "
                  f"{result['shape']['vocab_size']}), CUDA events, median:", ""]
        lines += [f"- {key}: {us:.0f} us" for key, us in result["verify_kernel_us"].items()]
    return "\n".join(lines) + "\n"


def plot_acceptance(result: dict, path: Path) -> bool:
    """One line per speculative setting: P(draft i accepted) against i. False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in result["runs"]:
        curve = r.get("acceptance_by_position") or []
        if curve:
            ax.plot(range(1, len(curve) + 1), curve, marker="o",
                    label=f"{r['setting']} c={r['concurrency']} p={r['prompt_len']}")
    title = "acceptance by draft position"
    if result.get("simulated_tokens_per_step") is not None:
        title += f" (SIMULATED: {result['simulated_tokens_per_step']} tokens/step, timing only)"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(draft i accepted)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(result: dict, out_dir: Path, quiet: bool = False) -> None:
    """Write the three files (after every run too, so a run cut short keeps what it measured)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "bench.md").write_text(markdown(result))
    if quiet:
        return
    plotted = plot_acceptance(result, out_dir / "acceptance.png")
    print(markdown(result))
    if not plotted:
        print("(matplotlib is not installed: no acceptance.png)")
