# A measuring device call of the perf work on issue 8 (carry .whl): the MoE kernel sweeps
# (bench/kernels/bench_moe.py, bench_moe_router.py), ft bench at the MoE shape over MOE_RUNS, and a
# few steps' kernels with a host/device timeline (scripts/diag/step_trace.py).
# At most 8 files land in $OUT; recorded under bench/results/.
set -u
SKIP_CONFORMANCE=1 SKIP_KERNELS=1 SKIP_BENCH=1 bash scripts/gpu_check.sh > /dev/null 2>&1   # setup only: /tmp/pkg, /tmp/site
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
moe=bench/shapes/qwen3.5-35b-a3b
if [ -z "${SKIP_SWEEPS:-}" ]; then
  timeout 150 python3 bench/kernels/bench_moe.py --out /tmp/bench_moe.json > $OUT/bench_moe.log 2>&1
  echo "bench_moe rc $?"; grep -E "^sweep N=(4|8) " $OUT/bench_moe.log; grep -E "^ +(1|4|8|16) " $OUT/bench_moe.log
  timeout 120 python3 bench/kernels/bench_moe_router.py --out /tmp/router.json > $OUT/router.log 2>&1
  echo "router rc $?"; python3 -c "
import json; r = json.load(open('/tmp/router.json'))
for row in r['results']:
    if row['experts'] == 256: print(row['rows'], round(row['triton_us'], 1), row['blocks'], [(s['blocks'], round(s['us'], 1)) for s in row['sweep']])
" 2>&1 | tail -5
fi
timeout "${BENCH_S:-240}" python3 -m dflash2.cli bench --model $moe --draft $moe-dflash2 --load-format dummy \
  --runs "${MOE_RUNS:-off:1:4096,dflash7:1:4096,dflash7:16:512}" --max-tokens 48 \
  --simulate-tokens-per-step 5.39 --out /tmp/bench-moe > /tmp/bench-moe.log 2>&1
echo "bench rc $?"; cp /tmp/bench-moe/bench.md $OUT/bench-moe.md; cp /tmp/bench-moe/bench.json $OUT/bench-moe.json
grep -E "^\| (off|dflash|mtp)" /tmp/bench-moe/bench.md || tail -5 /tmp/bench-moe.log
for spec in ${TRACES:-"qwen3.5-35b-a3b dflash7 4096 64" "qwen3.5-35b-a3b off 512 32" "qwen3.5-27b off 4096 24"}; do
  set -- $spec
  timeout 120 python3 scripts/diag/step_trace.py --model bench/shapes/$1 --draft bench/shapes/$1-dflash2 --setting $2 \
    --prompt-len $3 --timeline $4 --list 0 > $OUT/trace-$1-$2.txt 2>&1
  echo "trace $1 $2 rc $?"; grep -E "^== " $OUT/trace-$1-$2.txt; grep -A14 "^== timeline" $OUT/trace-$1-$2.txt | tail -14
done
