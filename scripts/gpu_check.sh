#!/usr/bin/env bash
# The GPU lane, for the device machine (H200, Python 3.12, its own torch and triton):
#   1. make `dflash2` importable without pip (the machine has no registry): symlinks under /tmp/pkg;
#   2. add carried wheels from .whl/ (flash-linear-attention) when present; .whl/ is not in git:
#      make it here with (and list /.whl/ in .git/info/exclude, then carry it: `carry: [".whl"]`)
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0
#   3. run the conformance suite on CUDA (fp32 and bf16 variants live in the tests);
#   4. run the engine benchmark;
#   5. print a short summary table last.
# Results land in $OUT (the device tool brings them back); record them under bench/results/.
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/gpu_check_out}
mkdir -p "$out" /tmp/pkg/dflash2
ln -sfn "$repo/reference" /tmp/pkg/dflash2/reference
ln -sfn "$repo/fast" /tmp/pkg/dflash2/fast
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"

start=$(date +%s)
python3 -m pytest -q -p no:cacheprovider conformance ${PYTEST_ARGS:-} 2>&1 | tee "$out/conformance.log"
conf_rc=${PIPESTATUS[0]}
conf_s=$(( $(date +%s) - start ))

bench_rc=0
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 bench/bench_engine.py --out "$out/bench.json" 2>&1 | tee "$out/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi

echo
echo "== summary =="
printf "%-28s %s\n" "gpu" "$(head -1 "$out/gpu.txt")"
printf "%-28s %s\n" "conformance (rc, seconds)" "$conf_rc, $conf_s"
printf "%-28s %s\n" "conformance result" "$(tail -1 "$out/conformance.log")"
printf "%-28s %s\n" "bench rc" "$bench_rc"
[ -f "$out/bench.json" ] && python3 bench/bench_engine.py --summarize "$out/bench.json"
exit $(( conf_rc != 0 || bench_rc != 0 ))
