"""The tokenizer and chat template a GGUF file carries in its metadata, as a transformers fast tokenizer.

Only what Qwen3.5-family files use: ``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE) with
``tokenizer.ggml.pre`` ``qwen35`` or ``qwen2``. Rebuilt as the HF ``tokenizer.json`` of those models
is laid out: NFC normalization, a split by the pre-tokenizer's regex, GPT-2's byte-to-character
map, BPE over ``tokenizer.ggml.tokens`` with ``tokenizer.ggml.merges`` ("a b" per merge, in
order), and the added tokens matched verbatim. ``tokenizer.ggml.token_type`` sorts the ids:
NORMAL (1) and BYTE (6) tokens form the BPE vocabulary, CONTROL (3) tokens are added as special,
USER_DEFINED (4) as added but not special (Qwen's ``<think>``), UNUSED (5) padding ids
(``[PAD500]``...) are left out so nothing can produce them. bos/eos/pad come from
``tokenizer.ggml.{bos,eos,padding}_token_id``, the template from ``tokenizer.chat_template``.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from .errors import ConfigError
from .gguf_file import GGUFModel

PRE_TOKENIZER_REGEX = {
    # Qwen3.5: letter runs may carry combining marks (\p{M})
    "qwen35": (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
               r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
    "qwen2": (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
              r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
}
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6


def gguf_tokenizer(model: GGUFModel) -> PreTrainedTokenizerFast:
    """The file's tokenizer; refuses a tokenizer model or pre-tokenizer other than the ones above."""
    kind = model.get("tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise ConfigError(f"{model.path}: tokenizer.ggml.model={kind!r}: expected 'gpt2' (byte-level BPE)")
    pre = model.get("tokenizer.ggml.pre", str)
    if pre not in PRE_TOKENIZER_REGEX:
        raise ConfigError(f"{model.path}: tokenizer.ggml.pre={pre!r}: expected one of {sorted(PRE_TOKENIZER_REGEX)}")
    tokens = model.get("tokenizer.ggml.tokens", list)
    types = model.get("tokenizer.ggml.token_type", list)
    if len(types) != len(tokens):
        raise ConfigError(f"{model.path}: tokenizer.ggml.token_type has {len(types)} entries; expected one per "
                          f"token ({len(tokens)})")
    merges = [tuple(m.split(" ", 1)) for m in model.get("tokenizer.ggml.merges", list)]
    vocab = {tok: i for i, (tok, t) in enumerate(zip(tokens, types)) if t in (NORMAL, BYTE)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [(i, AddedToken(tok, special=t == CONTROL, normalized=False))
             for i, (tok, t) in enumerate(zip(tokens, types)) if t in (CONTROL, USER_DEFINED)]
    for i, token in added:  # added in id order, each must land on its own id
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(token.content) != i:
            raise ConfigError(f"{model.path}: token {i} {token.content!r} (type {types[i]}) does not keep its id "
                              "when added; expected the added tokens after the BPE vocabulary")

    def token(key: str) -> str | None:
        i = model.get(f"tokenizer.ggml.{key}_token_id", int, None)
        return None if i is None else tokens[i]

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=token("bos"), eos_token=token("eos"),
                                   pad_token=token("padding"))
    template = model.get("tokenizer.chat_template", str, None)
    if template is not None:
        fast.chat_template = template
    return fast
