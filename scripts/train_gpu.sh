#!/usr/bin/env bash
# The training recipe's GPU stages, for the device machine (one H200, no registry, files back only
# through $OUT: at most 8 files of 16 MB). Usage, from the repo root on that machine:
#
#   bash scripts/train_gpu.sh target          # [SMOKE=1: a 30 s target + 20 s draft smoke run first]
#   bash scripts/train_gpu.sh draft           # needs runs/train/target/ (unpacked from the last call)
#   bash scripts/train_gpu.sh refine          # needs runs/train/draft/, or an exported pair:
#   TRAIN_FLAGS="--pair models/pycoder-10m" bash scripts/train_gpu.sh refine   # (then no stage need travel)
#   bash scripts/train_gpu.sh evaluate        # the last finished of refine/ or draft/
#
# Carry `.corpus`, `runs/train/recipe.json`, `runs/train/tokenizer` and only the finished stage the
# next one reads (`runs/train/target` for draft, `runs/train/draft` for refine, ...): a call carries
# at most 64 MiB with the working tree, which holds the 27 MB bundled pair, so all of runs/train
# does not fit. Token caches and stage states are rebuilt or not needed (`train_pack.sh carry`
# prunes them).
# Each stage's outputs come back packed by scripts/train_pack.sh (a tar split in 15 MB parts);
# unpack here with `bash scripts/train_pack.sh unpack <files_at>`.
set -euo pipefail
stage=$1
repo=$(pwd)
out=${OUT:-/tmp/train_out}
run=${RUN:-runs/train}
mkdir -p "$out" /tmp/pkg/dflash2
for p in reference fast bench train models; do ln -sfn "$repo/$p" /tmp/pkg/dflash2/$p; done
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
ft() { python3 -m dflash2.cli "$@"; }

if [ -n "${SMOKE:-}" ]; then  # the whole recipe for seconds on a copy of the run: fail fast, measure speed
  rm -rf /tmp/smoke && mkdir -p /tmp/smoke && cp -r "$run/tokenizer" "$run/recipe.json" /tmp/smoke/
  ft train target --run /tmp/smoke --seconds "${SMOKE_SECONDS:-30}" 2>&1 | tee "$out/smoke.log"
  ft train draft --run /tmp/smoke --seconds "${SMOKE_SECONDS:-20}" 2>&1 | tee -a "$out/smoke.log"
  ft train evaluate --run /tmp/smoke --eval-prompts 1 --eval-max-tokens 32 --eval-settings off,mtp3,dflash7 \
    --eval-modes greedy 2>&1 | tee -a "$out/smoke.log"
  cp -n /tmp/smoke/tokens-*.npy "$run/"  # the same corpus and tokenizer: tokenize once per machine
fi

ft train "$stage" --run "$run" ${TRAIN_FLAGS:-} 2>&1 | tee "$out/$stage.log"
bash scripts/train_pack.sh pack "$stage" "$run" "$out"
ls -la "$out"
