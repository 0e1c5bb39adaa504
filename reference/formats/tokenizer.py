"""The tokenizer of a checkpoint folder, as both engines load it.

:func:`load_tokenizer` reads ``tokenizer.json`` exactly as written, through transformers'
``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5), with
``tokenizer_config.json`` (special tokens) and ``chat_template.jinja`` (``apply_chat_template``),
offline. It does not go through ``AutoTokenizer``, which picks a class from ``config.json``'s
``model_type`` or the config's ``tokenizer_class``, and those classes rebuild the pipeline from
settings of their own: ``Qwen2Tokenizer`` (what Qwen3.5 releases name) splits with Qwen2's regex,
which lacks Qwen3.5's ``\\p{M}``, and ``Qwen3_5Tokenizer`` (chosen for ``model_type`` qwen3_5)
drops ``ignore_merges``; either can then disagree with the file, and with the reference
tiktoken encoding, on some texts.

:func:`check_tokenizer_fits` and :func:`eos_token_ids` hold the tokenizer to the model: every id
it can produce must index the embedding, and generation stops on the ids the checkpoint names.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from .errors import CheckpointError
from .gguf_file import GGUFModel, is_gguf_path
from .gguf_target import gguf_eos_ids
from .gguf_tokenizer import gguf_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(model_path: str | Path) -> bool:
    """Whether the folder ships tokenizer files at all (a checkpoint may come without); a GGUF file, whether its
    metadata holds a tokenizer."""
    if is_gguf_path(model_path):
        return GGUFModel(model_path).get("tokenizer.ggml.tokens", list, None) is not None
    return any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerFast:
    """The checkpoint's tokenizer (a GGUF file's from its metadata); raises :class:`CheckpointError` when its files
    are missing."""
    if is_gguf_path(model_path):
        return gguf_tokenizer(GGUFModel(model_path))
    model_path = Path(model_path)
    if not model_path.is_dir():
        raise CheckpointError(f"model path {str(model_path)!r}: expected a checkpoint folder")
    missing = [name for name in TOKENIZER_FILES if not (model_path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{str(model_path)!r} has no tokenizer: missing {', '.join(missing)} "
            f"(a Hugging Face checkpoint ships {' and '.join(TOKENIZER_FILES)})")
    return PreTrainedTokenizerFast.from_pretrained(str(model_path), local_files_only=True)


def max_token_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """The largest id the tokenizer can produce, over its BPE vocabulary and its added tokens."""
    return max(tokenizer.get_vocab().values())


def check_tokenizer_fits(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> None:
    """Raise :class:`CheckpointError` when the tokenizer can produce an id ``>= vocab_size``."""
    top = max_token_id(tokenizer)
    if top >= vocab_size:
        raise CheckpointError(f"tokenizer produces ids up to {top} but the model's vocab_size is {vocab_size}")


def eos_token_ids(model_path: str | Path, tokenizer: PreTrainedTokenizerFast | None = None) -> tuple[int, ...]:
    """The ids that end generation, from the first source that names any, in order:
    ``generation_config.json``, ``config.json`` (top level, then ``text_config``), the tokenizer's
    eos token. ``eos_token_id`` may be an int or a list; duplicates are dropped, order kept. A GGUF file: its
    metadata's eos and eot ids."""
    if is_gguf_path(model_path):
        ids = gguf_eos_ids(GGUFModel(model_path))
        if ids:
            return tuple(ids)
        raise CheckpointError(f"{str(model_path)!r}: no tokenizer.ggml.eos_token_id or eot_token_id in its metadata")
    model_path = Path(model_path)
    for name, keys in (("generation_config.json", [()]), ("config.json", [(), ("text_config",)])):
        config = _read_json(model_path / name)
        for key in keys:
            section = config
            for k in key:
                section = section.get(k) or {}
            ids = _as_ids(section.get("eos_token_id"), f"{name}: {'.'.join((*key, 'eos_token_id'))}")
            if ids:
                return ids
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    raise CheckpointError(f"{str(model_path)!r}: no eos_token_id in generation_config.json or config.json, "
                          "and no tokenizer eos token")


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{str(file)!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(file)!r}: expected a JSON object")
    return data


def _as_ids(value, field: str) -> tuple[int, ...]:
    """``None`` -> ``()``; an int or a list of ints -> a tuple without duplicates."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{field}={value!r}: expected a token id or a list of token ids")
    return tuple(dict.fromkeys(values))
