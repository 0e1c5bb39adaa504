"""llama.cpp's convert_hf_to_gguf.py, run as is but for the tiny tokenizer's pre-tokenizer name.

Usage: python scripts/gguf_convert.py <llama.cpp dir> <model dir> <converter arguments...>
(scripts/gguf_golden.sh and scripts/gguf_oracle.sh). The tiny tokenizer (reference/tiny/tokenizer.py
'small') splits text with Qwen3.5's regex but has its own 500-token vocabulary, whose fingerprint is
not in the converter's table of known pre-tokenizers; it is named 'qwen35' when, and only when,
tokenizer.json's split regex is Qwen3.5's exactly, and otherwise the converter refuses as usual.
"""

import json
import runpy
import sys
from pathlib import Path

llama = Path(sys.argv[1])
sys.argv = [str(llama / "convert_hf_to_gguf.py"), *sys.argv[2:]]
sys.path[:0] = [str(llama), str(llama / "gguf-py")]
from conversion.base import TextModel  # noqa: E402  (the sdist's, found through the path set above)

QWEN35_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
recognise = TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return recognise(self, tokenizer)
    except NotImplementedError:
        pre = json.loads((self.dir_model / "tokenizer.json").read_text())["pre_tokenizer"]
        if pre["pretokenizers"][0]["pattern"]["Regex"] != QWEN35_SPLIT:
            raise
        return "qwen35"


TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(sys.argv[0], run_name="__main__")
