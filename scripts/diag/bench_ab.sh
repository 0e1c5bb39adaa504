#!/usr/bin/env bash
# Interleaved A/B of `ft bench` between another tree (a baseline, e.g. `git archive <commit>` unpacked into
# .baseline/ and carried) and this one, on the device machine, in one call:
#   bash scripts/diag/bench_ab.sh BASE_DIR SHAPE SIMULATED PAIRS ROUNDS [ft bench flags...]
# runs ROUNDS rounds; each round starts one process per tree (base first in odd rounds, this tree first in even
# ones), each timing PAIRS off/dflash7 pairs (one request, 4096-token prompt, 128 new tokens, dummy weights,
# --simulate-tokens-per-step SIMULATED) on bench/shapes/SHAPE and its -dflash2 draft. Logs: $OUT/ab-<tree>-r<i>.log;
# scripts/diag/bench_pairs.py prints each process's pairs and both trees' medians last.
set -uo pipefail
base=$(cd "$1" && pwd) shape=$2 simulated=$3 pairs=$4 rounds=$5
shift 5
repo=$(pwd) out=${OUT:-/tmp/bench_ab}
shapes=${SHAPES_DIR:-$repo/bench/shapes} prompt_len=${PROMPT_LEN:-4096}  # a CPU dry run: a tiny pair, a short prompt
mkdir -p "$out"
source "$repo/scripts/diag/two_trees.sh"
runs=$(python3 -c "print(','.join(['off:1:$prompt_len,dflash7:1:$prompt_len'] * $pairs))")
bench_in() {  # $1 tree name, $2 round, then extra ft bench flags
  local tree=$1 round=$2
  shift 2
  local root=/tmp/pkg-$tree module=dflash2.cli
  [ -d "$root/dflash2/cli" ] || module=dflash2.fast  # trees before the cli package ran `python -m dflash2.fast`
  local start=$(date +%s)
  (cd "$( [ "$tree" = base ] && echo "$base" || echo "$repo")" && PYTHONPATH=$site$root python3 -m $module bench \
    --model "$shapes/$shape" --draft "$shapes/$shape-dflash2" --load-format dummy \
    --max-tokens 128 --simulate-tokens-per-step "$simulated" --runs "$runs" --out "/tmp/bench-ab-$tree-r$round" "$@") \
    > "$out/ab-$tree-r$round.log" 2>&1
  echo "$tree round $round rc $? in $(( $(date +%s) - start )) s" | tee -a "$out/ab-summary.txt"
}
for round in $(seq 1 "$rounds"); do
  if (( round % 2 )); then bench_in base "$round" "$@"; bench_in this "$round" "$@"
  else bench_in this "$round" "$@"; bench_in base "$round" "$@"; fi
done
python3 "$repo/scripts/diag/bench_pairs.py" "$out"/ab-*-r*.log | tee -a "$out/ab-summary.txt"
