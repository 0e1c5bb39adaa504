#!/usr/bin/env bash
# The wheels the GPU machine lacks (it has no package registry; its image lists what it holds), downloaded here into
# .whl/ for `carry: [".whl"]`: flash-linear-attention for the GDN kernels, gguf (the engine's config imports it; the
# GPU image lacks it), and the server stack (`ft serve`, bench/load_serve.py, SERVE_LOAD / MULTI_TURN of
# scripts/gpu_check.sh) pinned to this project's versions,
# each dependency named (pip download --no-deps fetches none): fastapi needs opentelemetry-api, pydantic its core,
# annotated-types and typing-inspection. List /.whl/ in .git/info/exclude first.
#   bash scripts/gpu_wheels.sh
set -euo pipefail
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0 gguf==0.19.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 opentelemetry-api==1.45.3 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
ls .whl
