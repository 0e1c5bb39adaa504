#!/usr/bin/env bash
# The main job on the bundled default: set up, then let the bundled trained pair (models/pycoder-10m:
# a small Qwen3.5 target and its DFlash 2 draft, trained by `ft train`, docs/training.md) complete a
# Python function with DFlash speculative decoding, and decode the same prompt without speculation
# to print the speedup measured in this run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
ft generate --prompt $'import os\n\n\ndef list_python_files(root):\n    """Return the paths of the .py files under root."""\n' \
  --speculative-algorithm dflash --speculative-num-steps 7 --max-tokens 128 --temperature 0 --ignore-eos \
  --compare-plain
