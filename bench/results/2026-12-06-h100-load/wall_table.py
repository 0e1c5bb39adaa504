"""Tokens per second from each run's wall clock (wall_s: the timed llm.generate, prefill included), not from the
StepClock's step times (tokens_per_s in bench.json), which miss the steps overlap scheduling runs ahead.
Usage: python3 wall_table.py (in this folder)."""
import glob, json
print("| file | setting | conc | T | steps seen | step ms median | step ms mean | wall s | prefill s | tok/s wall | "
      "tok/s decode-only (wall - prefill) | bench tok/s (StepClock) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for p in sorted(glob.glob("*.json")):
    for r in json.load(open(p))["runs"]:
        if "error" in r:
            continue
        n = r["concurrency"] * r["max_tokens"]
        print(f"| {p[:-5]} | {r['setting']} | {r['concurrency']} | {r.get('temperature') or 0:g} | {r['steps']} | "
              f"{r['step_ms_median']:.3f} | {r['step_ms_mean']:.3f} | {r['wall_s']:.4f} | {r['prefill_s']:.3f} | "
              f"{n / r['wall_s']:.0f} | {(n - r['concurrency']) / (r['wall_s'] - r['prefill_s']):.0f} | {r['tokens_per_s']:.0f} |")
