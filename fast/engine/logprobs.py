"""Log-probabilities of committed tokens under the target's distribution (the optional logprobs path).

For a committed token t drawn from the logits row z (the row that predicts its position), with the
request's sampling parameters (T, top_k, top_p):

    p = target_probs(z)             the filtered distribution the sampler draws from (``kernels/sampling/sampler.py``)
    logprob(t) = log p[t]
    top_logprobs = the n largest log p[j], probability descending, token id ascending on ties

A greedy request's p is the one-hot of argmax(z), which says nothing; its logprobs are taken from
softmax(z) instead (T = 1, no top-k/top-p), so the committed token is always its first
``top_logprobs`` entry. Tokens outside the filtered support have log p = -inf (a server clamps it for
JSON). With speculative decoding the committed tokens of a verify step are the rows 0..num_accepted
of that step ([anchor, y_1..y_k] row i predicts slot i + 1), and each gets log p at its own row:
speculative sampling emits tokens distributed as p, so these are the same numbers plain decoding
reports for the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dflash2.reference.request.sampling_params import TOP_K_OFF

from ..kernels.sampling.sampler import SamplingTensors, target_probs


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability and the ``len(top)`` most likely alternatives."""

    token_id: int
    logprob: float  # log p[token_id] (-inf outside the filtered support)
    top: tuple[tuple[int, float], ...] = ()  # (token id, log p), most likely first


def logprob_tensors(st: SamplingTensors) -> SamplingTensors:
    """The parameters logprobs are read under: greedy rows become T = 1 with no filter  # each [M]."""
    greedy = st.greedy
    return SamplingTensors(torch.where(greedy, torch.ones_like(st.temperature), st.temperature),
                           torch.where(greedy, torch.full_like(st.top_k, TOP_K_OFF), st.top_k),
                           torch.where(greedy, torch.ones_like(st.top_p), st.top_p), st.seeds)


def select_rows(st: SamplingTensors, rows: Tensor) -> SamplingTensors:
    """The parameters of ``rows [M]`` (indices into st's rows)."""
    return SamplingTensors(st.temperature[rows], st.top_k[rows], st.top_p[rows], st.seeds[rows])


def token_logprobs(logits: Tensor, st: SamplingTensors, tokens: Tensor, num_top: Sequence[int]) -> list[TokenLogprob]:
    """Row m: log p[tokens[m]] and its ``num_top[m]`` best entries.

    logits ``[M, V]`` (any float dtype), st: ``[M]`` per row, tokens ``[M]`` long, num_top: M host ints
    in [0, V]. One device-to-host copy of ``[M]`` logprobs and ``[M, max(num_top)]`` top entries.
    """
    rows = logits.shape[0]
    if len(num_top) != rows or tokens.shape != (rows,):
        raise ValueError(f"tokens {list(tokens.shape)} and num_top ({len(num_top)}): expected {rows} each, one per "
                         "logits row")
    if rows == 0:
        return []
    vocab = logits.shape[1]
    if any(not 0 <= n <= vocab for n in num_top):
        raise ValueError(f"num_top={list(num_top)}: expected integers in [0, {vocab}]")
    logp = torch.log(target_probs(logits, logprob_tensors(st)))  # [M, V] fp32, -inf off the support
    chosen = logp.gather(1, tokens[:, None].long())[:, 0].tolist()
    token_list = tokens.tolist()
    width = max(num_top)
    top_ids, top_lp = [[]] * rows, [[]] * rows
    if width:
        order = torch.sort(-logp, dim=1, stable=True).indices[:, :width]  # [M, n] desc, ids ascending on ties
        top_ids, top_lp = order.tolist(), logp.gather(1, order).tolist()
    return [TokenLogprob(token_list[m], chosen[m], tuple(zip(top_ids[m][:n], top_lp[m][:n])))
            for m, n in enumerate(num_top)]
