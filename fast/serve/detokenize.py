"""Streaming text that never takes a character back, and equals the engine's final text.

``IncrementalText`` follows one request's committed tokens. Text is decoded over a short window of
tokens (vLLM's incremental detokenization): with ``prefix`` the decoded window before the new tokens
and ``full`` the window with them, the new text is ``full[len(prefix):]``, taken only once it is
longer and does not end in U+FFFD (a UTF-8 character still split across tokens). What may be sent
is that text minus its longest suffix that begins a stop string: a stop string found by the engine
(``reference/request/stopping.py``) then always starts after the sent text, so the sent text is a
prefix of the final text the engine cuts before the stop string, and ``finish(final_text)`` sends
the rest (the last step's tokens go to ``finish`` alone: they may hold the whole stop string).
Streaming and non-streaming responses therefore carry the same text.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

logger = logging.getLogger("dflash2.fast.serve")
REPLACEMENT = "\ufffd"


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str] | None, stops: Sequence[str] = ()):
        self.decode, self.stops = decode, tuple(stops)
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far
        self.sent = 0  # characters of ``text`` handed out
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text

    def add(self, token_ids: Sequence[int]) -> str:
        """Take newly committed tokens; the text that may be sent now (often '')."""
        self.token_ids += token_ids
        if self.decode is None or not token_ids:
            return ""
        prefix = self.decode(self.token_ids[self._prefix:self._read])
        full = self.decode(self.token_ids[self._prefix:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.text += full[len(prefix):]
            self._prefix, self._read = self._read, len(self.token_ids)
        safe = len(self.text) - held_back(self.text, self.stops)
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text after what was sent (instead of ``add`` for the last
        tokens: those may hold a whole stop string, which the final text cuts)."""
        sent = self.text[:self.sent]
        if final_text.startswith(sent):
            return final_text[self.sent:]
        # cannot happen with a prefix-stable tokenizer; the final text wins in non-streaming responses
        logger.warning("streamed text %r is not a prefix of the final text %r", sent[-40:], final_text[-40:])
        return ""


class TokenStrings:
    """Per-token strings and bytes for logprobs, cached: ``(token, utf-8 bytes)`` of one id.

    A byte-level BPE token (Qwen's) maps back to its exact bytes, so a token holding part of a UTF-8
    character keeps its bytes; its string is those bytes decoded with replacement. Without a
    tokenizer a token is ``token_id:N`` (vLLM's spelling).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_of: dict[str, int] | None = None
        if tokenizer is not None:
            from dflash2.reference.tiny.tokenizer import byte_to_unicode

            self._byte_of = {ch: b for b, ch in byte_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(ch in self._byte_of for ch in piece):
            raw = bytes(self._byte_of[ch] for ch in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode())
