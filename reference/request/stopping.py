"""When a request ends, shared by plain and speculative decoding.

A request ends after ``max_tokens`` tokens (finish reason "length"), at the first stop id unless
``ignore_eos`` (the stop id is kept, reason "stop"), or at the first stop string (the text is cut
before it, reason "stop"). A speculative step may commit several tokens at once; the output is
cut at the first of these events inside them, so it equals what token-by-token decoding gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..formats.errors import RequestError
from .sampling_params import SamplingParams


@dataclass
class Stopper:
    """``max_tokens`` overrides ``params.max_tokens`` (an engine caps it by its context length)."""

    params: SamplingParams
    stop_token_ids: Sequence[int] = ()
    decode: Callable[[list[int]], str] | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.params.max_tokens
        if self.params.stop and self.decode is None:
            raise RequestError(f"stop={list(self.params.stop)!r}: expected no stop strings for a checkpoint "
                               "without a tokenizer (they are matched on decoded text)")
        self._stop_ids = set() if self.params.ignore_eos else set(self.stop_token_ids)
        self.text: str | None = None  # set when a stop string cut the text

    def check(self, output: list[int], checked: int = 0) -> tuple[list[int], str | None]:
        """(the output cut at the first ending event, its finish reason or None to go on). ``checked``: how many
        leading tokens an earlier check already passed (they hold no stop id), so only the new ones are scanned
        for one: a long output costs no more per step than a short one."""
        for i in range(checked, len(output)):
            if output[i] in self._stop_ids:
                return output[:i + 1], "stop"
        if self.params.stop:
            text = self.decode(output)
            hits = [text.find(s) for s in self.params.stop if s in text]
            if hits:
                self.text = text[:min(hits)]
                return output, "stop"
        if len(output) >= self.max_tokens:
            return output[:self.max_tokens], "length"
        return output, None

    def final_text(self, output: list[int]) -> str:
        if self.text is not None:
            return self.text
        return self.decode(output) if self.decode is not None else ""


def timing(start: float, prefill_end: float, end: float, num_tokens: int) -> dict[str, float]:
    total = end - start
    return {"prefill_s": prefill_end - start, "decode_s": end - prefill_end, "total_s": total,
            "output_tokens_per_s": num_tokens / total if total > 0 else 0.0}
