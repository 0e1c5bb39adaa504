#!/usr/bin/env bash
# Set up and run the whole CPU test suite (unit tests and the conformance suite).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
gpu_only=()
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || gpu_only=(-m "not gpu")
python -m pytest -q "${gpu_only[@]}" "$@"
