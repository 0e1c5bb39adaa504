"""Per-request sampling parameters, validated the same way by both engines."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..formats.errors import RequestError, expect, is_int

TOP_K_OFF = -1


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for.

    ``temperature`` 0 (or ``top_k`` 1) is greedy. Otherwise the target's distribution is
    softmax(logits / temperature), then restricted to the ``top_k`` most likely tokens
    (``top_k = -1``: off), then to the smallest most-likely set whose mass reaches ``top_p``,
    renormalised (see ``reference/speculative/sampling.py``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_OFF
    seed: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> None:
        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        expect(is_int(self.max_tokens) and self.max_tokens >= 1, RequestError, "max_tokens", self.max_tokens,
               "an integer >= 1")
        expect(is_num(self.temperature) and self.temperature >= 0, RequestError, "temperature", self.temperature,
               "a finite number >= 0 (0 is greedy)")
        expect(is_num(self.top_p) and 0 < self.top_p <= 1, RequestError, "top_p", self.top_p,
               "a number in (0, 1]")
        expect(is_int(self.top_k) and (self.top_k == TOP_K_OFF or self.top_k >= 1), RequestError, "top_k",
               self.top_k, f"{TOP_K_OFF} (off) or an integer >= 1")
        expect(is_int(self.seed) and 0 <= self.seed < 2**64, RequestError, "seed", self.seed,
               "an integer in [0, 2^64)")
        for s in self.stop:
            expect(isinstance(s, str) and s != "", RequestError, "stop", s, "non-empty strings")
        expect(isinstance(self.ignore_eos, bool), RequestError, "ignore_eos", self.ignore_eos, "true or false")
