#!/usr/bin/env bash
# Regenerate the golden GGUF files of tests/formats/gguf/golden with llama.cpp's own converter.
#
# The opt-in lane of issue 35: nothing is built. The converter (convert_hf_to_gguf.py, its
# conversion/ package and the gguf-py it vendors, which knows the `dflash` arch) is pure Python and
# ships in the llama-cpp-python 0.3.36 source distribution; it runs on the tiny checkpoints that
# reference/tiny writes. Usage (from the repository root, network for the one sdist download):
#
#     scripts/gguf_golden.sh                 # default interpreter .venv/bin/python
#     PYTHON=python3 LLAMA_CPP_SDIST=/path/to/llama_cpp_python-0.3.36 scripts/gguf_golden.sh
#
# Two departures from a plain converter run, both outside the tensor mapping under test:
# - the tiny tokenizer (reference/tiny/tokenizer.py 'small') splits text with Qwen3.5's regex but
#   has its own 500-token vocabulary, whose fingerprint is not in the converter's table of known
#   pre-tokenizers; the wrapper scripts/gguf_convert.py names it 'qwen35' when, and only when,
#   tokenizer.json's split regex is Qwen3.5's exactly, and otherwise lets the converter refuse as usual;
# - the tiny draft's config.json gains "use_sliding_window": true, without which the converter
#   drops the window (dflash.attention.sliding_window) and llama.cpp would run the draft unwindowed.
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
VERSION=0.3.36
OUT=tests/formats/gguf/golden
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

source "$(dirname "$0")/llama_cpp_sdist.sh"  # sets LLAMA

"$PYTHON" - "$WORK/src" <<'PY'
import json, sys
from pathlib import Path
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target

src = Path(sys.argv[1])
for preset in ("tiny-dense", "tiny-moe"):
    write_tiny_target(src / preset, preset, tokenizer="small")
draft = write_tiny_draft(src / "draft", src / "tiny-dense")
config = json.loads((draft / "config.json").read_text())
(draft / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}, indent=2) + "\n")
PY

convert() {  # convert <source folder> <output file> <converter arguments...>
    local src=$1 out=$2; shift 2
    "$PYTHON" scripts/gguf_convert.py "$LLAMA" "$WORK/src/$src" --outfile "$out" "$@" > "$WORK/log" 2>&1 \
        || { cat "$WORK/log"; exit 1; }
}

rm -rf "$OUT"/*.gguf "$OUT/draft-f32-split"
mkdir -p "$OUT/draft-f32-split"
convert tiny-dense "$OUT/tiny-dense-f32.gguf" --outtype f32
convert tiny-dense "$OUT/tiny-dense-f16.gguf" --outtype f16
convert tiny-dense "$OUT/tiny-dense-q8_0.gguf" --outtype q8_0
convert tiny-moe "$OUT/tiny-moe-f32.gguf" --outtype f32
convert tiny-moe "$OUT/tiny-moe-bf16-fused.gguf" --outtype bf16 --fuse-gate-up-exps
convert draft "$OUT/draft-f32.gguf" --outtype f32 --target-model-dir "$WORK/src/tiny-dense"
convert draft "$OUT/draft-q8_0.gguf" --outtype q8_0 --target-model-dir "$WORK/src/tiny-dense"
convert draft "$OUT/draft-f32-split/draft-f32.gguf" --outtype f32 --split-max-tensors 16 \
    --target-model-dir "$WORK/src/tiny-dense"

# The sources' fingerprints: the tests regenerate the tiny checkpoints and compare against these first.
"$PYTHON" - "$WORK/src" "$OUT/sources.json" "$VERSION" <<'PY'
import json, sys
from pathlib import Path
from dflash2.reference.tiny.fingerprint import fingerprint

src, out, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
prints = {f"{f.parent.name}/{f.name}": fingerprint(f)
          for f in sorted(src.glob("*/*")) if f.suffix in (".safetensors", ".json")}
out.write_text(json.dumps({"llama_cpp_python": version, "fingerprints": prints}, indent=2) + "\n")
PY
ls -l "$OUT" "$OUT/draft-f32-split"
