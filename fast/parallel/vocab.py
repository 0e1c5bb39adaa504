"""The vocabulary-parallel embedding and LM head (vLLM's VocabParallelEmbedding / ParallelLMHead).

Rank r of tp holds the vocabulary rows ``[r V/tp, (r+1) V/tp)`` of the embedding ``E [V, C]`` and of the
head ``W_lm [V, C]`` (the same rows when they are tied).

Embedding: each rank looks up the tokens in its range and writes zeros for the others, and the sum over
ranks (one all-reduce) is ``E[t]``: exactly one rank contributes each row, so the sum is exact in any
dtype (x + 0 = x) and the rows equal the tp=1 lookup bit for bit.

LM head: each rank computes its slice ``logits[:, V_r] = h W_lm[V_r]^T  # [M, V/tp]`` and an all-gather
concatenates them in rank order, so every rank holds the full ``[M, V]`` logits (the sampler then runs
replicated, each rank drawing the same token; vLLM gathers to rank 0 only, which needs the tokens broadcast).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .group import TPGroup


def parallel_embed(embed: Tensor, token_ids: Tensor, tp: TPGroup) -> Tensor:
    """``E[token_ids]  # [N, C]`` from this rank's rows ``embed [V/tp, C]``, summed over the ranks."""
    local_vocab = embed.shape[0]
    local = token_ids - tp.rank * local_vocab  # [N]: the row in this rank's slice, if it falls there
    mine = (local >= 0) & (local < local_vocab)
    rows = embed[torch.where(mine, local, 0)]  # [N, C]; row 0 stands in for the others, masked next
    rows = torch.where(mine[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return tp.all_reduce(rows)


def parallel_lm_head(hidden: Tensor, lm_head: Tensor, tp: TPGroup) -> Tensor:
    """Full fp32 logits ``[M, V]``: this rank's ``[M, V/tp]`` slice of ``hidden [M, C] @ W_lm^T``, gathered.

    ``lm_head`` is dense (tensor parallelism refuses quantized weights for now: fast/model/params.py)."""
    return tp.all_gather((hidden @ lm_head.T).float(), dim=-1)
