#!/usr/bin/env bash
# Create .venv (once) and install dflash2 with its test extras into it.
# The CPU machines take torch from the 2.13.0 CPU wheel on local disk; an unpinned torch would
# pull a multi-GB CUDA build, so it is pinned here and nowhere else (the package keeps a range).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
quiet=(--quiet --disable-pip-version-check)
python -m pip install "${quiet[@]}" --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install "${quiet[@]}" "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
python -m pip install "${quiet[@]}" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import torch, dflash2.reference, dflash2.fast; print('environment ready: torch', torch.__version__)"
