"""The tokenizer a GGUF file carries encodes, decodes and templates as the HF tokenizer it came from."""

from __future__ import annotations

from conftest import GOLDEN
from dflash2.reference.formats.gguf_file import GGUFModel
from dflash2.reference.formats.gguf_tokenizer import gguf_tokenizer
from dflash2.reference.formats.tokenizer import load_tokenizer

TEXTS = [
    "Hello world, the capital of France is Paris.",
    "déjà vu: naïve café 123 4567\n\n  x",
    "<|im_start|>user\nhi<|im_end|>\n<think>ok</think>",
    "emoji 🚀 and 中文 text\t\ttabs   ",
    "I've been 'told' he's there, 'RE you sure?",
]


def test_tokenizer_matches_hf(sources):
    ours, theirs = gguf_tokenizer(GGUFModel(GOLDEN / "tiny-dense-q8_0.gguf")), load_tokenizer(sources / "tiny-dense")
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.pad_token_id) == (theirs.eos_token_id, theirs.pad_token_id)
    assert len(ours) == len(theirs)  # the [PADn] ids that fill the vocabulary to 512 are not tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
