#!/usr/bin/env bash
# The main job on the bundled default: set up, write the tiny default checkpoint, decode one chat prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
model=runs/tiny-dense
[ -f "$model/config.json" ] || ft make-tiny --preset tiny-dense --out "$model"
ft generate --model "$model" --engine reference --chat --prompt "Write a haiku about speculative decoding." \
  --max-tokens 24 --temperature 0.8 --top-p 0.95 --top-k 20 --seed 7 --json
