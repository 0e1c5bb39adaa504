"""The tokenizer stage on a small corpus: its exact size, the Qwen special tokens, the round trip on
held-out text, the folder the checkpoint loader reads, and the uint16 token stream."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from dflash2.reference.formats.chat_template import CHAT_TEMPLATE
from dflash2.reference.formats.errors import UserInputError
from dflash2.reference.formats.tokenizer import check_tokenizer_fits, load_tokenizer
from dflash2.reference.tiny.tokenizer import SMALL_SPECIAL_TOKENS, TRAINING_TEXT
from dflash2.train.corpus import build_corpus, iter_documents
from dflash2.train.corpus_sources import Source
from dflash2.train.tokenizer import tokenize_corpus, train_tokenizer

VOCAB = 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Twenty-four short documents (prose paragraphs and small functions); one of them quotes a
    special token, as the transformers sources do. About one in four is held out."""
    root = tmp_path_factory.mktemp("src")
    paragraphs = [p for p in TRAINING_TEXT.split("\n\n") if p.strip()]
    for i in range(24):
        text = (paragraphs[i % len(paragraphs)] + "\n" +
                f"def scale_{i}(values, factor={i}):\n    return [v * factor for v in values]\n")
        if i == 5:
            text += 'EOS = "<|endoftext|>"\n'
        (root / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(out, sources=[Source("fake", root, "*.txt")], heldout_percent=25)
    return out


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    return out, train_tokenizer(corpus, out, vocab_size=VOCAB)


def test_size_is_exactly_what_was_asked_with_special_tokens_last(trained):
    folder, info = trained
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert info.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
    ids = [tokenizer.token_to_id(name) for name in SMALL_SPECIAL_TOKENS]
    assert ids == list(range(VOCAB - 5, VOCAB))
    assert (info.endoftext_id, info.im_start_id, info.im_end_id, info.think_start_id, info.think_end_id) == tuple(ids)
    assert info.eos_token_ids == (ids[2], ids[0])


def test_special_tokens_are_single_ids_anywhere_in_text(trained):
    folder, info = trained
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode("a<|im_start|>user\nhi<|im_end|><think>x</think>b<|endoftext|>").ids
    for name, token_id in zip(SMALL_SPECIAL_TOKENS, range(VOCAB - 5, VOCAB)):
        assert ids.count(token_id) == 1, name


def test_held_out_text_round_trips(corpus, trained):
    folder, _ = trained
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    heldout = list(iter_documents(corpus, "heldout"))
    assert heldout
    for text in [*heldout, "naïve café, ünïcödé 東京 and emoji \U0001F600\ttabs\n\n  spaces"]:
        ids = tokenizer.encode(text).ids
        assert max(ids) < VOCAB and tokenizer.decode(ids) == text
    # Merges were learned: the held-out prose takes well under one token per byte.
    assert sum(len(t.encode()) for t in heldout) > 1.5 * sum(len(tokenizer.encode(t).ids) for t in heldout)


def test_the_folder_loads_as_a_checkpoint_tokenizer(trained):
    folder, info = trained
    assert (folder / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    tokenizer = load_tokenizer(folder)
    check_tokenizer_fits(tokenizer, VOCAB)
    assert tokenizer.eos_token_id == info.im_end_id and tokenizer.pad_token_id == info.endoftext_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == info.im_start_id and ids.count(info.im_end_id) == 1


def test_training_is_deterministic_and_max_bytes_limits_the_text(corpus, trained, tmp_path):
    folder, _ = trained
    train_tokenizer(corpus, tmp_path / "again", vocab_size=VOCAB)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    record = json.loads((tmp_path / "again" / "tokenizer_training.json").read_text())
    train_tokenizer(corpus, tmp_path / "short", vocab_size=300, max_bytes=1000)
    short = json.loads((tmp_path / "short" / "tokenizer_training.json").read_text())
    assert short["trained_bytes"] <= 1000 < record["trained_bytes"]
    with pytest.raises(UserInputError, match="vocab_size=4000.*merges"):
        train_tokenizer(corpus, tmp_path / "big", vocab_size=4000, max_bytes=1000)
    with pytest.raises(UserInputError, match="vocab_size"):
        train_tokenizer(corpus, tmp_path / "tiny", vocab_size=261)


def test_tokenize_corpus_joins_documents_with_endoftext(corpus, trained):
    folder, info = trained
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    docs = list(iter_documents(corpus, "train"))
    stream = tokenize_corpus(corpus, folder, "train", workers=2)
    assert stream.dtype == np.uint16
    # Only the boundaries are <|endoftext|>: the one a document quotes is encoded as its text.
    assert int((stream == info.endoftext_id).sum()) == len(docs) - 1
    pieces = np.split(stream, np.flatnonzero(stream == info.endoftext_id))
    decoded = [tokenizer.decode(p[1:] if i else p) for i, p in enumerate(pieces)]
    assert decoded == docs
    assert np.array_equal(tokenize_corpus(corpus, folder, "train", workers=1), stream)


def test_tokenize_corpus_refuses_ids_past_uint16(corpus, tmp_path):
    vocab = {f"t{i}": i for i in range(2**16 + 1)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserInputError, match="uint16"):
        tokenize_corpus(corpus, tmp_path, "train")
