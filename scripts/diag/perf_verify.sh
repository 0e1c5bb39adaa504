# The checking device call of a perf round on issue 8 (carry .whl): the GPU tests of the step path and
# the MoE kernels, ft bench at one shape (SHAPE, RUNS, SIM: the seed's tokens per verify step), and a
# host/device timeline of that shape's steps (scripts/diag/step_trace.py; TRACES=setting:prompt_len:steps,...;
# TRACE_MODE=host-split for the host's parts without a profiler; TRACES= for none; SKIP_TESTS=1, SKIP_FT_BENCH=1 skip those parts).
# At most 8 files land in $OUT.
set -u
SKIP_CONFORMANCE=1 SKIP_KERNELS=1 SKIP_BENCH=1 bash scripts/gpu_check.sh > /dev/null 2>&1   # setup only: /tmp/pkg, /tmp/site
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
shape=${SHAPE:-qwen3.5-35b-a3b}
if [ -z "${SKIP_TESTS:-}" ]; then
  start=$(date +%s)
  timeout "${TEST_S:-240}" python3 -m pytest -v -p no:cacheprovider ${TESTS:-conformance/ops/test_moe.py \
    conformance/ops/test_moe_router.py conformance/layers/test_fast_moe_shared_expert.py conformance/gpu/test_cuda_graphs.py} \
    > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc $? in $(( $(date +%s) - start )) s"; tail -2 $OUT/gpu_tests.log; grep -E "^FAILED|^ERROR| FAILED" $OUT/gpu_tests.log | head
fi
if [ -z "${SKIP_FT_BENCH:-}" ]; then
  timeout "${BENCH_S:-240}" python3 -m dflash2.cli bench --model bench/shapes/$shape --draft bench/shapes/$shape-dflash2 \
    --load-format dummy --runs "${RUNS:-off:1:512,off:1:4096,dflash7:1:4096,off:16:512,dflash7:16:512}" --max-tokens 48 \
    --simulate-tokens-per-step ${SIM:-5.39} --out /tmp/bench > /tmp/bench.log 2>&1
  echo "bench rc $?"; cp /tmp/bench/bench.md $OUT/bench-$shape.md; cp /tmp/bench/bench.json $OUT/bench-$shape.json
  grep -E "^\| (off|dflash|mtp)" /tmp/bench/bench.md || tail -5 /tmp/bench.log
fi
for spec in $(echo "${TRACES-dflash7:4096:64,off:512:32}" | tr , ' '); do   # setting:prompt_len:steps,...
  set -- $(echo "$spec" | tr : ' ')
  timeout 120 python3 scripts/diag/step_trace.py --model bench/shapes/$shape --draft bench/shapes/$shape-dflash2 \
    --setting $1 --prompt-len $2 --${TRACE_MODE:-timeline} $3 --list 0 > $OUT/trace-$shape-$1.txt 2>&1
  echo "trace $1 rc $?"; grep -E "^== " $OUT/trace-$shape-$1.txt; grep -A10 -E "^== (timeline|host split)" $OUT/trace-$shape-$1.txt | tail -10
done
