# One device call of the perf work on issue 8 (carry .whl): the GPU tests of the kernels this round
# touched, then one captured step's kernels per shape (scripts/diag/step_trace.py) and a host profile
# of MoE decoding. Results land in $OUT; recorded under bench/results/.
set -u
SKIP_CONFORMANCE=1 SKIP_KERNELS=1 SKIP_BENCH=1 bash scripts/gpu_check.sh > /dev/null 2>&1   # setup only: /tmp/pkg, /tmp/site
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider conformance/ops/test_moe.py conformance/ops/test_moe_router.py \
  conformance/ops/test_gdn_commit.py conformance/ops/test_gdn_recurrent.py conformance/ops/test_ring_attention.py \
  conformance/ops/test_dynamic_conv.py conformance/ops/test_attention_prologue.py conformance/layers/test_fast_moe_shared_expert.py \
  conformance/gpu/test_kernels_at_released_shapes.py conformance/gpu/test_cuda_graphs.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - start )) s"; tail -3 $OUT/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head
for spec in ${TRACES:-"qwen3.5-35b-a3b off 512 24" "qwen3.5-35b-a3b dflash7 512 0" "qwen3.5-27b off 4096 0" "qwen3.5-27b dflash7 4096 0"}; do
  set -- $spec
  timeout 150 python3 scripts/diag/step_trace.py --model bench/shapes/$1 --draft bench/shapes/$1-dflash2 --setting $2 \
    --prompt-len $3 --host-profile $4 --list 140 --out $OUT/trace-$1-$2.json > $OUT/trace-$1-$2.txt 2>&1
  echo "$spec rc $?"; grep -E "^== |^host:" $OUT/trace-$1-$2.txt
done
