# The device call behind bench/results/2026-12-01-h200-sampled-graphs/ and -h200-serve/warm/ (carry .corpus .whl):
# the verifier law at 1e8 and the CUDA-graph tests, T=1 evaluation of the bundled pair, ft serve under load.
set -u
SKIP_CONFORMANCE=1 SKIP_KERNELS=1 SKIP_BENCH=1 bash scripts/gpu_check.sh > /dev/null 2>&1   # setup only: /tmp/pkg, /tmp/site
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
DFLASH2_LAW_ROWS=1e8 timeout 330 python3 -m pytest -q -s -p no:cacheprovider conformance/gpu/test_verifier_law_at_scale.py conformance/gpu/test_cuda_graphs.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - start )) s"; grep -E "verifier law|passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -20
start=$(date +%s)
timeout 150 python3 -m dflash2.cli train evaluate --run /tmp/evalrun --pair models/pycoder-10m --corpus .corpus --eval-modes t1 --report $OUT/eval_t1 > $OUT/evaluate_t1.log 2>&1
echo "eval rc $? in $(( $(date +%s) - start )) s"; tail -9 $OUT/evaluate_t1.log
SKIP_CONFORMANCE=1 SKIP_KERNELS=1 SKIP_BENCH=1 SERVE_LOAD=1 timeout 200 bash scripts/gpu_check.sh > $OUT/gpu_check.txt 2>&1
echo "serve rc $?"; grep -E "warm-up|ready in" $OUT/serve-load.log | cut -c1-200; tail -10 $OUT/serve-load.log
