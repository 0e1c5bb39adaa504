"""load_tokenizer and its checks: the chat template's exact output, the vocabulary fit, the stop
ids, and the errors a user sees for a folder without a tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2.reference.formats.errors import CheckpointError
from dflash2.reference.formats.tokenizer import check_tokenizer_fits, eos_token_ids, load_tokenizer

SYSTEM_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
]


def _chat(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# --- chat template ------------------------------------------------------------------------------------


def test_chat_template_generation_prompt_thinks_by_default(small_tokenizer):
    assert _chat(small_tokenizer, SYSTEM_USER, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")


def test_chat_template_without_thinking_closes_an_empty_block(small_tokenizer):
    assert _chat(small_tokenizer, SYSTEM_USER, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_without_generation_prompt(small_tokenizer):
    assert _chat(small_tokenizer, SYSTEM_USER) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n")


def test_chat_template_multi_turn(small_tokenizer):
    """Earlier assistant turns lose their reasoning; the turn after the last query keeps it (empty
    block when there is none); contents are trimmed."""
    messages = [
        {"role": "user", "content": "  Hi  "},
        {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"},
        {"role": "user", "content": "Add 2 and 2."},
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 = 4"},
    ]
    assert _chat(small_tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nAdd 2 and 2.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n2 + 2 = 4\n</think>\n\n4<|im_end|>\n")


def test_chat_template_tool_results_are_a_user_turn(small_tokenizer):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "20 C"},
    ]
    assert _chat(small_tokenizer, messages, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n20 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_rejects_a_late_system_message(small_tokenizer):
    with pytest.raises(Exception, match="System message must be at the beginning"):
        _chat(small_tokenizer, [SYSTEM_USER[1], SYSTEM_USER[0]])


def test_chat_prompt_tokens(small_tokenizer, qwen_tokenizer):
    """Markers are single ids, in both tokenizers."""
    for tokenizer in (small_tokenizer, qwen_tokenizer):
        ids = tokenizer.encode(_chat(tokenizer, SYSTEM_USER, add_generation_prompt=True), add_special_tokens=False)
        start, end, think = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<think>"))
        assert [i for i in ids if i in (start, end, think)] == [start, end, start, end, start, think]
        assert ids[-2:] == [think, tokenizer.convert_tokens_to_ids("Ċ")]  # "<think>\n"


# --- vocabulary fit and stop ids --------------------------------------------------------------------------


def test_check_tokenizer_fits(small_tokenizer, qwen_tokenizer):
    check_tokenizer_fits(small_tokenizer, 500)
    check_tokenizer_fits(small_tokenizer, 512)
    check_tokenizer_fits(qwen_tokenizer, 248320)
    with pytest.raises(CheckpointError, match="tokenizer produces ids up to 499 but the model's vocab_size is 499"):
        check_tokenizer_fits(small_tokenizer, 499)
    with pytest.raises(CheckpointError, match="tokenizer produces ids up to 248076 but the model's vocab_size is 512"):
        check_tokenizer_fits(qwen_tokenizer, 512)


def _folder_with(tmp_path, small_dir, **files):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(small_dir / name, tmp_path / name)
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    ({"generation_config": {"eos_token_id": [497, 495, 497]}, "config": {"eos_token_id": 1}}, (497, 495)),
    ({"generation_config": {"eos_token_id": 497}}, (497,)),
    ({"generation_config": {"do_sample": True}, "config": {"eos_token_id": 495}}, (495,)),
    ({"config": {"eos_token_id": None, "text_config": {"eos_token_id": 495}}}, (495,)),
    ({}, (497,)),  # the tokenizer's eos_token, <|im_end|>
])
def test_eos_token_ids(tmp_path, small_dir, small_tokenizer, files, expected):
    assert eos_token_ids(_folder_with(tmp_path, small_dir, **files), small_tokenizer) == expected


@pytest.mark.parametrize("files, message", [
    ({"generation_config": "{not json"}, "generation_config.json' is not valid JSON"),
    ({"generation_config": {"eos_token_id": "497"}}, "generation_config.json: eos_token_id='497': expected a token id"),
    ({"config": {"text_config": {"eos_token_id": [True]}}}, r"config.json: text_config.eos_token_id=\[True\]"),
])
def test_eos_token_ids_rejects_malformed_files(tmp_path, small_dir, files, message):
    with pytest.raises(CheckpointError, match=message):
        eos_token_ids(_folder_with(tmp_path, small_dir, **files))


def test_eos_token_ids_without_any_source(tmp_path):
    with pytest.raises(CheckpointError, match="no eos_token_id"):
        eos_token_ids(tmp_path)


# --- missing files ---------------------------------------------------------------------------------------------


def test_missing_tokenizer_files(tmp_path, small_dir):
    with pytest.raises(CheckpointError, match="missing tokenizer.json, tokenizer_config.json"):
        load_tokenizer(tmp_path)
    shutil.copy(small_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"has no tokenizer: missing tokenizer_config.json \(a Hugging Face"):
        load_tokenizer(tmp_path)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="expected a checkpoint folder"):
        load_tokenizer(tmp_path / "nowhere")


# --- with the checkpoint factory ------------------------------------------------------------------------------------


def test_tiny_checkpoint_tokenizer(tmp_path):
    """The factory's tiny target carries the small tokenizer; it fits the model and stops on im_end."""
    from dflash2.reference.tiny.target import write_tiny_target

    path = write_tiny_target(tmp_path / "tiny", "tiny-dense")
    vocab_size = json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]
    tokenizer = load_tokenizer(path)
    check_tokenizer_fits(tokenizer, vocab_size)
    assert eos_token_ids(path, tokenizer) == (497, 495)
