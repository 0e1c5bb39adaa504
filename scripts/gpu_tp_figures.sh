#!/usr/bin/env bash
# Issue 36's multi-GPU run on a machine with 4 GPUs (nvidia-h100-x4; one with 2 runs the tp=2 half), part by part:
# the CUDA tensor-parallel conformance (tp=2 and tp=4 against tp=1, NCCL through fast/parallel/nccl.py, captured
# target forwards), then ft bench at the 27B shape at tp=1, 2 and 4 and the 35B-A3B shape at tp=1 and 2, plain
# decode and DFlash k=7 at the seed's simulated acceptance, each step beside its per-rank floor (the rank's bytes
# over the copy bandwidth plus the collectives over the all-reduce bandwidth measured in the same run).
# Required (issue 36): the 27B tp=2 decode step <= 0.6x the tp=1 step; DFlash k=7 still faster than plain.
# Run from a frozen copy of the tree with the carried wheels (scripts/gpu_wheels.sh), as scripts/gpu_open_figures.sh:
#
#     PARTS=tests bash scripts/gpu_tp_figures.sh; PARTS=27b ...; PARTS=35b ...    # results in $OUT/tp.tgz
#
# A device call runs at most 10 minutes and each ft bench up to about 280 s, so one part per call, and the 27B part
# in two: PARTS=27b TPS="1 2", then PARTS=27b TPS=4 (TPS: the tensor-parallel sizes a part runs; default all).
set -uo pipefail
. scripts/gpu_env.sh
O=${OUT:-/tmp/tp}/tp
mkdir -p "$O"
GPUS=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nvidia-smi topo -m; \
  cat REV 2>/dev/null || git rev-parse --short HEAD; } > "$O/gpu.txt" 2>&1
PARTS=${PARTS:-tests 27b 35b}
has() { [[ " $PARTS " == *" $1 "* ]]; }
has tests && timeout 300 python3 -m pytest -q -p no:cacheprovider conformance/gpu/test_nccl_capture.py conformance/gpu/test_tp_cuda.py \
  > "$O/tp_tests.log" 2>&1 && echo "tp_tests passed" >> "$O/steps.txt" || echo "tp_tests failed" >> "$O/steps.txt"
BENCH="python3 -m dflash2.cli bench --simulate-tokens-per-step seed --max-tokens 64 --load-format dummy"
S27="--model bench/shapes/qwen3.5-27b --draft bench/shapes/qwen3.5-27b-dflash2"
S35="--model bench/shapes/qwen3.5-35b-a3b --draft bench/shapes/qwen3.5-35b-a3b-dflash2"
for tp in ${TPS:-1 2 4}; do
  { has 27b && [ "$tp" -le "$GPUS" ]; } || continue
  timeout 280 $BENCH $S27 --tp $tp --runs off:1:512,dflash7:1:512,off:16:512,dflash7:16:512 --out "$O/27b-tp$tp" \
    > "$O/27b-tp$tp.log" 2>&1; echo "27b tp=$tp rc=$?" >> "$O/steps.txt"
done
for tp in ${TPS:-1 2}; do
  { has 35b && [ "$tp" -le "$GPUS" ]; } || continue
  timeout 280 $BENCH $S35 --tp $tp --runs off:1:512,dflash7:1:512 --out "$O/35b-tp$tp" > "$O/35b-tp$tp.log" 2>&1
  echo "35b tp=$tp rc=$?" >> "$O/steps.txt"
done
cat "$O/steps.txt"
(cd "$(dirname "$O")" && tar czf tp.tgz tp && rm -rf tp)
