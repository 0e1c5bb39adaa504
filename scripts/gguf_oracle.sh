#!/usr/bin/env bash
# Regenerate tests/formats/gguf/golden/llama: llama.cpp as the numeric oracle on quantized GGUF files.
#
# The opt-in lane of issue 35 (the CPU tests only read its committed output,
# tests/formats/gguf/test_llama_oracle.py). Usage, from the repository root:
#
#     scripts/gguf_oracle.sh           # downloads the llama-cpp-python 0.3.36 sdist, builds it (~5 min on 2 cores)
#     LLAMA_CPP_PYTHON=/path/to/target LLAMA_CPP_SDIST=/path/to/llama_cpp_python-0.3.36 scripts/gguf_oracle.sh
#
# LLAMA_CPP_PYTHON: a folder holding the built `llama_cpp` package (as `pip install --target` leaves
# it, with lib/libllama.so and lib/libggml*.so); LLAMA_CPP_SDIST: the extracted sdist (its
# vendor/llama.cpp has the converter). PYTHON: the interpreter (default .venv/bin/python; needs
# numpy, torch, safetensors and gguf for the tiny checkpoints and the converter).
#
# Steps:
# 1. build llama-cpp-python 0.3.36 from its sdist, CPU only (pip install --no-deps --target; the
#    multimodal library is not built: CMAKE_ARGS=-DLLAVA_BUILD=OFF), unless LLAMA_CPP_PYTHON is given;
# 2. write the tiny checkpoints tiny-dense-256 and tiny-moe-256 (reference/tiny/target.py; hidden
#    size 256 so K-quant and IQ rows fit) and convert them with llama.cpp's convert_hf_to_gguf.py
#    (through scripts/gguf_convert.py, as scripts/gguf_golden.sh does) at --outtype f32 --no-mtp
#    (the presets have no MTP head, and the converter asserts one unless told --no-mtp);
# 3. scripts/gguf_oracle.py: quantize each F32 file with llama.cpp's quantizer (llama_model_quantize,
#    pure) to Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS and IQ3_XXS (IQ3_XXS with a uniform importance matrix:
#    llama.cpp refuses that type without one), run llama.cpp on CPU on the F32 file and each
#    quantized file (logits of every prompt position, greedy tokens, token ids in) and dequantize
#    rows of each weight with ggml's own code; write the quantized files, oracle.npz and oracle.json.
# The F32 files are not committed: the tests compare llama.cpp's F32 logits with the safetensors source.
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
VERSION=0.3.36
OUT=tests/formats/gguf/golden/llama
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

source "$(dirname "$0")/llama_cpp_sdist.sh"  # sets LLAMA

if [[ -z "${LLAMA_CPP_PYTHON:-}" ]]; then
    LLAMA_CPP_PYTHON="$WORK/llama-cpp-python"
    echo "building llama-cpp-python $VERSION from $LLAMA_CPP_SDIST (CPU) ..."
    CMAKE_ARGS="-DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" "$PYTHON" -m pip install --quiet --no-deps \
        --target "$LLAMA_CPP_PYTHON" "$LLAMA_CPP_SDIST" > "$WORK/build.log" 2>&1 || { tail -50 "$WORK/build.log"; exit 1; }
fi

"$PYTHON" - "$WORK/src" <<'PY'
import sys
from pathlib import Path
from dflash2.reference.tiny.target import write_tiny_target

for preset in ("tiny-dense-256", "tiny-moe-256"):
    write_tiny_target(Path(sys.argv[1]) / preset, preset, tokenizer="small")
PY

for preset in tiny-dense-256 tiny-moe-256; do
    "$PYTHON" scripts/gguf_convert.py "$LLAMA" "$WORK/src/$preset" --outfile "$WORK/$preset-f32.gguf" \
        --outtype f32 --no-mtp > "$WORK/log" 2>&1 || { cat "$WORK/log"; exit 1; }
done

rm -rf "$OUT"
mkdir -p "$OUT"
PYTHONPATH="$LLAMA_CPP_PYTHON${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" scripts/gguf_oracle.py "$WORK" "$OUT" "$WORK/src" \
    2> "$WORK/llama.log" || { tail -80 "$WORK/llama.log"; exit 1; }
ls -l "$OUT"
