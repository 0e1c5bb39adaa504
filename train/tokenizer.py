"""The tokenizer, stage 2 of the training recipe: a byte-level BPE trained on the corpus's train split.

Same pipeline as the tiny models' ``'small'`` tokenizer (``reference/tiny/tokenizer.py``, whose
helpers build it here, private ones included): NFC, Qwen3.5's pre-tokenizer regex, GPT-2's
byte-level table, BPE, then the five Qwen special tokens ``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>``, ``<think>``, ``</think>`` appended as the last ids and matched verbatim. So
``vocab_size`` ids in all = 256 bytes + (vocab_size - 261) merges + 5 special tokens, and the
folder (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) loads through
``reference/formats/tokenizer.py`` like any checkpoint's.

:func:`tokenize_corpus` turns a split into one ``uint16`` stream: each document's ids, with one
``<|endoftext|>`` between documents. Special-token strings written inside a document (the
transformers sources hold a few ``<|endoftext|>``) are encoded as plain text there, so every
``<|endoftext|>`` id in the stream is a document boundary. ``<think>`` and ``</think>`` are not
special tokens in Qwen's vocabulary and stay matched.

``python -m dflash2.train.tokenizer --corpus .corpus --out runs/train/tokenizer`` trains it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from ..reference.formats.errors import UserInputError, expect
from ..reference.tiny.tokenizer import (
    ENDOFTEXT, SMALL_SPECIAL_TOKENS, TokenizerInfo, _add_special_tokens, _with_qwen_pipeline, save_tokenizer_files)
from .corpus import DEFAULT_OUT as DEFAULT_CORPUS, MANIFEST, iter_documents, read_manifest

KIND = "trained"
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_OUT = Path("runs/train/tokenizer")
NUM_BYTES = 256
TRAINING_RECORD = "tokenizer_training.json"
ENCODE_BATCH_DOCS = 64
UINT16_IDS = 2**16


def train_tokenizer(corpus_dir: str | Path, out_dir: str | Path = DEFAULT_OUT, *,
                    vocab_size: int = DEFAULT_VOCAB_SIZE, max_bytes: int | None = None) -> TokenizerInfo:
    """Train on the train split (its first ``max_bytes`` UTF-8 bytes when given) and write the
    tokenizer folder into ``out_dir``; ``vocab_size`` counts every id, special tokens included."""
    smallest = NUM_BYTES + 1 + len(SMALL_SPECIAL_TOKENS)
    expect(isinstance(vocab_size, int) and vocab_size >= smallest, UserInputError, "vocab_size", vocab_size,
           f"an integer of at least {smallest} (256 bytes, a merge, {len(SMALL_SPECIAL_TOKENS)} special tokens)")
    expect(max_bytes is None or (isinstance(max_bytes, int) and max_bytes > 0), UserInputError,
           "max_bytes", max_bytes, "None or a positive integer")
    bpe_size = vocab_size - len(SMALL_SPECIAL_TOKENS)
    tokenizer = _with_qwen_pipeline(Tokenizer(BPE()))
    trainer = BpeTrainer(vocab_size=bpe_size, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         special_tokens=[], show_progress=False)
    counted = {"docs": 0, "bytes": 0}
    tokenizer.train_from_iterator(_first_bytes(iter_documents(corpus_dir, "train"), max_bytes, counted),
                                  trainer=trainer)
    learned = tokenizer.get_vocab_size(with_added_tokens=False)
    if learned != bpe_size:
        raise UserInputError(f"vocab_size={vocab_size}: the {counted['bytes']} training bytes of {corpus_dir} "
                             f"give only {learned - NUM_BYTES} merges that occur twice, expected {bpe_size - NUM_BYTES}")
    _add_special_tokens(tokenizer, SMALL_SPECIAL_TOKENS)

    out_dir = Path(out_dir)
    info = save_tokenizer_files(out_dir, tokenizer, KIND, pretty=False)
    manifest_sha = hashlib.sha256((Path(corpus_dir) / MANIFEST).read_bytes()).hexdigest()
    record = {"corpus_manifest_sha256": manifest_sha, "vocab_size": vocab_size, "max_bytes": max_bytes,
              "trained_docs": counted["docs"], "trained_bytes": counted["bytes"]}
    (out_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if info.vocab_size != vocab_size or tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"trained tokenizer has {info.vocab_size} ids, asked for {vocab_size}")
    return info


def _first_bytes(docs: Iterator[str], max_bytes: int | None, counted: dict) -> Iterator[str]:
    """``docs`` up to ``max_bytes`` UTF-8 bytes in all, the last one cut at a character boundary."""
    for doc in docs:
        if max_bytes is not None:
            left = max_bytes - counted["bytes"]
            if left <= 0:
                return
            doc = doc.encode("utf-8")[:left].decode("utf-8", errors="ignore")
        counted["docs"] += 1
        counted["bytes"] += len(doc.encode("utf-8"))
        yield doc


def load_trained_tokenizer(tokenizer_dir: str | Path) -> Tokenizer:
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise UserInputError(f"tokenizer folder {str(tokenizer_dir)!r}: no tokenizer.json (train it first)")
    return Tokenizer.from_file(str(path))


def tokenize_corpus(corpus_dir: str | Path, tokenizer_dir: str | Path, split: str, *,
                    workers: int | None = os.cpu_count()) -> np.ndarray:
    """The split's documents as one ``uint16`` array ``[N]``: ids of document 0, ``<|endoftext|>``,
    ids of document 1, ... (none after the last). ``workers`` threads each run ``encode_batch`` on
    a batch of documents (it releases the GIL), with the library's own thread pool off so the
    count is what was asked."""
    expect(workers is None or (isinstance(workers, int) and workers > 0), UserInputError, "workers", workers,
           "None or a positive integer")
    read_manifest(corpus_dir)  # a clear error for a folder that is not a corpus
    tokenizer = load_trained_tokenizer(tokenizer_dir)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    expect(size <= UINT16_IDS, UserInputError, f"{tokenizer_dir} vocab size", size,
           f"at most {UINT16_IDS} ids, to fit uint16")
    tokenizer.encode_special_tokens = True  # special-token text inside a document is text
    separator = np.array([tokenizer.token_to_id(ENDOFTEXT)], dtype=np.uint16)

    def encode(batch: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint16) for e in tokenizer.encode_batch(batch, add_special_tokens=False)]

    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with ThreadPoolExecutor(max_workers=workers or 1) as pool:
            pieces = [ids for batch in pool.map(encode, _batches(iter_documents(corpus_dir, split))) for ids in batch]
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    joined = [part for i, ids in enumerate(pieces) for part in ((separator, ids) if i else (ids,))]
    return np.concatenate(joined) if joined else np.zeros(0, dtype=np.uint16)


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == ENCODE_BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


def main(argv: Sequence[str] | None = None) -> TokenizerInfo:
    parser = argparse.ArgumentParser(prog="python -m dflash2.train.tokenizer", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="corpus folder (default %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="tokenizer folder (default %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="ids in all (default %(default)s)")
    parser.add_argument("--max-mb", type=float, default=None, help="train on the first MiB of text only")
    args = parser.parse_args(argv)
    max_bytes = None if args.max_mb is None else int(args.max_mb * 2**20)
    info = train_tokenizer(args.corpus, args.out, vocab_size=args.vocab_size, max_bytes=max_bytes)
    print(f"{args.out}: {info.vocab_size} ids, <|endoftext|>={info.endoftext_id}, <|im_end|>={info.im_end_id}")
    return info


if __name__ == "__main__":
    main()
