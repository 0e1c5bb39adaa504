#!/usr/bin/env bash
# The main job on the bundled default: set up, write the tiny default target and its DFlash 2 draft,
# then decode one chat prompt with DFlash speculative decoding on the fast engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
model=runs/tiny-dense
draft=runs/tiny-dense-dflash2
[ -f "$model/config.json" ] && [ -f "$draft/config.json" ] || ft make-tiny --preset tiny-dense --out "$model" --draft-out "$draft"
ft generate --model "$model" --chat --prompt "Write a haiku about speculative decoding." \
  --speculative-algorithm dflash --speculative-draft-model-path "$draft" \
  --max-tokens 24 --temperature 0.8 --top-p 0.95 --top-k 20 --seed 7 --json
