# The closing device call of the perf round on issue 8 (carry .whl): the GPU tests this round touched,
# ft bench at both real shapes (the runs), and one MoE decode step's trace with a host profile.
set -u
SKIP_CONFORMANCE=1 SKIP_KERNELS=1 SKIP_BENCH=1 bash scripts/gpu_check.sh > /dev/null 2>&1   # setup only: /tmp/pkg, /tmp/site
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 200 python3 -m pytest -q -rf --tb=short -p no:cacheprovider conformance/ops/test_moe_router.py \
  conformance/ops/test_gdn_commit.py conformance/ops/test_attention_prologue.py conformance/layers/test_fast_moe_shared_expert.py \
  conformance/gpu/test_cuda_graphs.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc $?"; tail -4 $OUT/gpu_tests.log
run_bench() {  # shape sim runs
  timeout 260 python3 -m dflash2.fast bench --model bench/shapes/$1 --draft bench/shapes/$1-dflash2 --load-format dummy \
    --runs "$3" --max-tokens 48 --simulate-tokens-per-step $2 --out /tmp/bench-$1 > /tmp/bench-$1.log 2>&1
  echo "bench $1 rc $?"; cp /tmp/bench-$1/bench.md $OUT/bench-$1.md; cp /tmp/bench-$1/bench.json $OUT/bench-$1.json
  grep -E "^\| (off|dflash|mtp)" /tmp/bench-$1/bench.md
}
run_bench qwen3.5-35b-a3b 5.39 off:1:512,off:1:4096,dflash7:1:512,dflash7:1:4096,off:16:512,dflash7:16:512
run_bench qwen3.5-27b 5.47 off:1:512,off:1:4096,dflash7:1:4096,off:16:512,dflash7:16:512
timeout 90 python3 scripts/diag/step_trace.py --model bench/shapes/qwen3.5-35b-a3b --setting off --prompt-len 512 \
  --host-profile 24 --list 0 > $OUT/trace-moe-off.txt 2>&1
grep -E "^== |^host:" $OUT/trace-moe-off.txt
