#!/usr/bin/env bash
# Speculation under load on the bundled pair (models/pycoder-10m), this tree beside a baseline tree, in one device call:
#   bash scripts/diag/load_figures.sh BASE_DIR [LEVELS]
# BASE_DIR: another tree (e.g. `git archive <commit> reference fast bench models cli | tar -x -C .baseline`, carried);
# LEVELS: concurrency levels (default 1,8,32,64). Per tree, `ft bench` with the eight Python prompts
# (bench/prompts/python-8.json: real acceptance), 128 new tokens, bf16, CUDA graphs, every run warmed up first:
#   greedy     off and dflash7 at each level, fixed depth        (DFlash k=7 greedy vs plain)
#   sampled    the same at temperature 1, top-p 0.95             (T=1 vs plain T=1; sampled plain step vs greedy's)
#   adaptive   this tree only, --speculative-depth adaptive      (adaptive vs plain at every level)
# Logs and results in $OUT/<tree>-<kind>/ (bench.md, bench.json); a summary table last: tok/s vs plain per level
# and the step times. A tree whose ft bench lacks a flag (--temperature, --speculative-depth) reports the run failed.
set -uo pipefail
base=$(cd "$1" && pwd) levels=${2:-1,8,32,64}
repo=$(pwd) out=${OUT:-/tmp/load_figures}
mkdir -p "$out"
source "$repo/scripts/diag/two_trees.sh"
runs=$(python3 -c "print(','.join(f'off:{c}:64,dflash7:{c}:64' for c in '$levels'.split(',')))")
bench_in() {  # $1 tree, $2 kind, then extra ft bench flags
  local tree=$1 kind=$2
  shift 2
  local dir root=/tmp/pkg-$tree start=$(date +%s)
  dir=$( [ "$tree" = base ] && echo "$base" || echo "$repo")
  (cd "$dir" && PYTHONPATH=$site$root python3 -m dflash2.cli bench --model "$repo/models/pycoder-10m/target" \
    --draft "$repo/models/pycoder-10m/draft" --prompts "$repo/bench/prompts/python-8.json" --max-tokens 128 \
    --runs "$runs" --out "$out/$tree-$kind" "$@") > "$out/$tree-$kind.log" 2>&1
  echo "$tree $kind rc $? in $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
}
bench_in base greedy
bench_in this greedy
bench_in base sampled --temperature 1 --top-p 0.95
bench_in this sampled --temperature 1 --top-p 0.95
bench_in this adaptive --speculative-depth adaptive
python3 - "$out" <<'EOF' | tee -a "$out/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| tree | kind | conc | plain tok/s | dflash7 tok/s | vs plain | plain step ms | dflash7 step ms | tok/step |")
print("|---|---|---|---|---|---|---|---|---|")
for path in sorted(out.glob("*/bench.json")):
    tree, kind = path.parent.name.split("-", 1)
    runs = json.loads(path.read_text())["runs"]
    off = {r["concurrency"]: r for r in runs if r["setting"] == "off" and "error" not in r}
    for r in runs:
        if r["setting"] != "dflash7" or "error" in r or r["concurrency"] not in off:
            continue
        o = off[r["concurrency"]]
        print(f"| {tree} | {kind} | {r['concurrency']} | {o['tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / o['tokens_per_s']:.2f}x | {o['step_ms_median']:.2f} | {r['step_ms_median']:.2f} | "
              f"{r['tokens_per_step']:.2f} |")
# sampled plain decode's step over greedy plain decode's, per tree and level (issue 32: <= 1.3x at one request)
steps = {}
for path in out.glob("*/bench.json"):
    tree, kind = path.parent.name.split("-", 1)
    for r in json.loads(path.read_text())["runs"]:
        if r["setting"] == "off" and "error" not in r:
            steps[(tree, kind, r["concurrency"])] = r["step_ms_median"]
for (tree, kind, conc), ms in sorted(steps.items()):
    if kind == "sampled" and (tree, "greedy", conc) in steps:
        print(f"- {tree} c={conc}: sampled plain step / greedy plain step = {ms:.3f} / "
              f"{steps[(tree, 'greedy', conc)]:.3f} ms = {ms / steps[(tree, 'greedy', conc)]:.2f}x")
EOF
