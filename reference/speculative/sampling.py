"""The target's filtered distribution p, and drawing a token from a distribution with one uniform.

Order of operations (the fast sampler uses the same one):

1. temperature: ``p = softmax(logits / T)`` in fp32 (T > 0);
2. top-k: keep the ``k`` most likely tokens (``k = -1``: keep all);
3. top-p: over the mass renormalised after top-k, keep the smallest most-likely prefix whose
   mass reaches ``top_p`` (a token is kept when the mass strictly before it is < top_p, so the
   most likely token always survives);
4. renormalise what is kept.

"Most likely first" is probability descending, token id ascending on ties; this fixes which of
several equal tokens a top-k or top-p cut keeps. Greedy (T = 0 or k = 1) is the one-hot of
argmax(logits), ties going to the lowest id.

A token is drawn from a distribution with a single uniform u in (0, 1) by inverting the CDF in
token-id order: the smallest id j with ``cumsum(p)[j] > u * sum(p)``.
"""

from __future__ import annotations

import torch

from ..request.sampling_params import TOP_K_OFF, SamplingParams


def greedy_token(logits: torch.Tensor) -> int:
    """argmax with ties to the lowest id  # logits [V]."""
    return int(torch.argmax(logits))  # torch.argmax returns the first maximal index


def most_likely_order(probs: torch.Tensor) -> torch.Tensor:
    """Token ids by probability descending, id ascending on ties  # [V] -> [V]."""
    ids = torch.arange(probs.numel())
    # a stable sort on -p keeps ascending ids among equal probabilities
    return ids[torch.sort(-probs, stable=True).indices]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's filtered distribution p  # logits [V] -> probs [V] fp32, summing to 1."""
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs[greedy_token(logits)] = 1.0
        return probs
    probs = torch.softmax(logits / params.temperature, dim=-1)
    order = most_likely_order(probs)
    keep = torch.ones(probs.numel(), dtype=torch.bool)
    if params.top_k != TOP_K_OFF:
        keep[params.top_k:] = False
    if params.top_p < 1.0:
        sorted_probs = probs[order] * keep
        sorted_probs = sorted_probs / sorted_probs.sum()
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        keep &= mass_before < params.top_p
    kept = torch.zeros_like(probs)
    kept[order[keep]] = probs[order[keep]]
    return kept / kept.sum()


def sample_from_probs(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw in token-id order  # probs [V] (need not be normalised), u in (0, 1)."""
    cdf = torch.cumsum(probs.double(), dim=0)
    j = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    # guard the float edge u * total == total: fall back to the last token with mass
    return min(j, int(torch.nonzero(probs > 0)[-1]))
