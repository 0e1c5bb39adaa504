"""The law speculative decoding must keep, enumerated exactly, and how far a sample of outputs strays from it.

Speculative sampling is correct when the first n committed tokens of a request are distributed as if each were
drawn from the target alone::

    P(t_1 .. t_n) = p(t_1 | prompt) p(t_2 | prompt, t_1) ... p(t_n | prompt, t_1 .. t_{n-1})

with p the target's filtered distribution (``sampling.target_probs``: temperature, top-k, top-p). With top-k on
and a small n this is a short enumeration (k^n cells), so a test can compare the outputs of many seeded requests
with it, cell by cell, in standard errors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..request.sampling_params import SamplingParams
from .sampling import target_probs


def exact_sequence_law(target, prompt: list[int], num_tokens: int,
                       params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Every continuation of ``num_tokens`` tokens the target can sample after ``prompt`` under ``params``, with its
    probability (the product above); ``target.forward(ids [T]).logits [T, V]`` is the reference target's."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(num_tokens):
        grown = {}
        for prefix, mass in law.items():
            p = target_probs(target.forward(torch.tensor(prompt + list(prefix))).logits[-1], params)
            for t in torch.nonzero(p).flatten().tolist():
                grown[prefix + (t,)] = mass * float(p[t])
        law = grown
    return law


def worst_deviation(exact: dict[tuple[int, ...], float], samples: Iterable[tuple[int, ...]]) -> float:
    """The largest ``|f - p| / sqrt(p (1 - p) / n)`` over every cell either law gives mass (f: the cell's share of
    the n ``samples``, p: its exact probability); inf if a sample is a sequence the target cannot produce."""
    counts: dict[tuple[int, ...], int] = {}
    for cell in samples:
        counts[tuple(cell)] = counts.get(tuple(cell), 0) + 1
    n = sum(counts.values())
    worst = 0.0
    for cell in set(exact) | set(counts):
        p, f = exact.get(cell, 0.0), counts.get(cell, 0) / n
        if p == 0.0:
            return math.inf
        worst = max(worst, abs(f - p) / math.sqrt(p * (1 - p) / n))
    return worst
