#!/usr/bin/env bash
# The GPU lane, for the device machine (H200, Python 3.12, its own torch and triton):
#   1. make `dflash2` importable without pip (the machine has no registry): symlinks under /tmp/pkg;
#   2. add carried wheels from .whl/ (flash-linear-attention; fastapi, uvicorn and their needs for stage 7) when
#      present; .whl/ is not in git: make it here with `bash scripts/gpu_wheels.sh` (list /.whl/ in
#      .git/info/exclude first, then carry it: `carry: [".whl"]`)
#   3. run the conformance suite on CUDA (fp32 and bf16 variants live in the tests);
#   4. run the kernel micro-benchmarks (bench/kernels/bench_*.py), each beside its floor;
#   5. run `ft bench` at the real shapes (bench/shapes/, --load-format dummy) over BENCH_RUNS
#      (setting:concurrency:prompt_len,...; the default below covers the issue's figures), with the
#      seed's tokens per step of each setting simulated (timing only; `--simulate-tokens-per-step seed`;
#      BENCH_SIM overrides, BENCH_SIM= turns it off);
#      BENCH_SHAPES, BENCH_TOKENS, BENCH_FLAGS change it; BENCH_WEIGHT_TYPES="bf16 Q4_K IQ3_XXS" runs each shape with
#      its matrices as random GGUF blocks of each type too (issue 35's figures; floors count the blocks' bytes);
#   6. print a short summary table last (after stage 7 when it runs): each ft bench row through its prefill tok/s
#      and prefill floor columns (the rest of the table is in bench.md);
#   7. with SERVE_LOAD=1, bench/load_serve.py against `ft serve` (MoE shape, dummy weights, loopback); with
#      MULTI_TURN=1, its multi-turn chat workload with the prefix cache on and off (MoE shape, DFlash k=7);
# SKIP_CONFORMANCE=1 / SKIP_KERNELS=1 / SKIP_BENCH=1 skip a stage. Seen on the H200 (2026-12-01): the kernel
# benches take ~2.5 min (2026-12-02: bench_skinny_linear adds ~2.3 min, three times that since its prefetch variants (2026-12-04: six shape and row-count cases in 6 min), bench_ring_attention ~40 s), ft bench ~5 min a shape, so with conformance the lane outgrows one 10-minute
# device call: run it as two or three calls (e.g. SKIP_BENCH=1, then SKIP_CONFORMANCE=1 SKIP_KERNELS=1). Results land in $OUT (the device tool
# brings them back); record them under bench/results/. The conformance stage alone outgrows a call too (2026-12-03: no end
# within 600 s on a cold machine without conformance/gpu/test_cuda_graphs.py, which takes ~9 min by itself): CONFORMANCE_PATHS
# (default: conformance) runs part of it, e.g. "conformance/ops conformance/layers", then "conformance/draft conformance/tokens
# conformance/distribution", then conformance/gpu in a call or two; its log is written as it runs, so a call cut short keeps
# what had passed.
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/gpu_check_out}
mkdir -p "$out" /tmp/pkg/dflash2
ln -sfn "$repo/reference" /tmp/pkg/dflash2/reference
ln -sfn "$repo/fast" /tmp/pkg/dflash2/fast
ln -sfn "$repo/bench" /tmp/pkg/dflash2/bench
ln -sfn "$repo/train" /tmp/pkg/dflash2/train
ln -sfn "$repo/models" /tmp/pkg/dflash2/models
ln -sfn "$repo/cli" /tmp/pkg/dflash2/cli
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"

conf_rc=0 conf_s=0
if [ -z "${SKIP_CONFORMANCE:-}" ]; then
  start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider ${CONFORMANCE_PATHS:-conformance} ${PYTEST_ARGS:-} 2>&1 | tee "$out/conformance.log"
  conf_rc=${PIPESTATUS[0]}
  conf_s=$(( $(date +%s) - start ))
fi

kernels_rc=0
if [ -z "${SKIP_KERNELS:-}" ]; then
  for script in bench/kernels/bench_*.py; do
    [ -f "$script" ] || continue
    name=$(basename "$script" .py)
    python3 "$script" --out "$out/$name.json" 2>&1 | tee "$out/$name.log" || kernels_rc=1
  done
fi

bench_rc=0
default_runs=off:1:512,off:1:4096,mtp3:1:4096,mtp7:1:4096,dflash3:1:4096,dflash7:1:4096,dflash7:1:512
default_runs=$default_runs,off:4:512,dflash7:4:512,off:16:512,dflash7:16:512
if [ -z "${SKIP_BENCH:-}" ]; then
  for shape in ${BENCH_SHAPES:-qwen3.5-35b-a3b qwen3.5-27b}; do
    case "$shape" in  # each setting at the seed's measured tokens per verify step for this family (AIME25)
      *27b|*35b-a3b) sim=seed ;; *) sim= ;;
    esac
    sim=${BENCH_SIM-$sim}
    for wtype in ${BENCH_WEIGHT_TYPES:-bf16}; do  # e.g. "bf16 Q4_K IQ3_XXS": the matrices as GGUF blocks of each
      name=$shape; wflag=
      [ "$wtype" != bf16 ] && name=$shape-$wtype && wflag="--dummy-weight-type $wtype"
      python3 -m dflash2.cli bench --model "bench/shapes/$shape" --draft "bench/shapes/$shape-dflash2" \
        --load-format dummy $wflag --runs "${BENCH_RUNS:-$default_runs}" \
        --max-tokens "${BENCH_TOKENS:-64}" ${sim:+--simulate-tokens-per-step "$sim"} ${BENCH_FLAGS:-} \
        --out "$out/bench-$name" 2>&1 | tee "$out/bench-$name.log" || bench_rc=1
    done
  done
fi

serve_rc=0
if [ -n "${SERVE_LOAD:-}" ]; then  # ft serve under a bounded loopback load, on the MoE shape with dummy weights
  python3 bench/load_serve.py --num-requests 64 --concurrency 16 --input-len 512 --output-len 64 \
    --duration-s 60 --timeout-s 60 --out "$out/serve-load.json" -- \
    --model bench/shapes/qwen3.5-35b-a3b --load-format dummy --max-running-requests 16 --max-model-len 2048 \
    2>&1 | tee "$out/serve-load.log" || serve_rc=1
fi

multi_rc=0
if [ -n "${MULTI_TURN:-}" ]; then  # the prefix cache on a multi-turn chat (issue 33): cache on and off, DFlash k=7
  python3 bench/load_serve.py --multi-turn --compare-no-cache --out "$out/multi-turn.json" -- \
    --model bench/shapes/qwen3.5-35b-a3b --speculative-algorithm dflash \
    --speculative-draft-model-path bench/shapes/qwen3.5-35b-a3b-dflash2 --load-format dummy \
    --max-running-requests 8 --max-model-len 4096 2>&1 | tee "$out/multi-turn.log" || multi_rc=1
fi

echo
echo "== summary =="
printf "%-28s %s\n" "gpu" "$(head -1 "$out/gpu.txt")"
[ -z "${SKIP_CONFORMANCE:-}" ] && printf "%-28s %s\n" "conformance (rc, seconds)" "$conf_rc, $conf_s" \
  && printf "%-28s %s\n" "conformance result" "$(tail -1 "$out/conformance.log")"
printf "%-28s %s\n" "kernel benches rc" "$kernels_rc"
for f in "$out"/bench_*.log; do [ -f "$f" ] && { echo "-- $(basename "$f" .log)"; tail -12 "$f"; }; done
printf "%-28s %s\n" "ft bench rc" "$bench_rc"
for d in "$out"/bench-*/; do
  [ -f "$d/bench.md" ] && { echo "-- $(basename "$d")"; grep '^- bf16 matmul' "$d/bench.md"; grep '^|' "$d/bench.md" | cut -d'|' -f1-15 | sed 's/[^|]$/&|/'; }
done
[ -n "${SERVE_LOAD:-}" ] && printf "%-28s %s\n" "serve load rc" "$serve_rc" && tail -14 "$out/serve-load.log"
[ -n "${MULTI_TURN:-}" ] && printf "%-28s %s\n" "multi-turn rc" "$multi_rc" && grep '^|' "$out/multi-turn.log" | head -14
exit $(( conf_rc != 0 || kernels_rc != 0 || bench_rc != 0 || serve_rc != 0 || multi_rc != 0 ))
