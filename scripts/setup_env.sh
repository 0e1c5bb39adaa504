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
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install "${quiet[@]}" --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  python -m pip install "${quiet[@]}" "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
# the editable install once per change of pyproject.toml (a reinstall prints setuptools' editable-install
# warning every time, and the demo and the tests run this script first)
stamp=.venv/.dflash2-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! python -c "import dflash2.cli, dflash2.fast" 2>/dev/null; then
  # setuptools' note on editable installs (a folder named like the package may shadow it) is dropped: the
  # package-dir mapping installs dflash2.* from these folders, nothing here is named dflash2
  python -m pip install "${quiet[@]}" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" \
    | awk '/BuildBackendWarning/ {skip = 1} !skip {print} /with strategy, WheelFile/ {skip = 0}' || true
  echo "$want" > "$stamp"
fi
python -c "import torch, dflash2.reference, dflash2.fast, dflash2.cli; print('environment ready: torch', torch.__version__)"
