"""The DFlash 2 candidate selector: a path of k draft tokens and the draft distribution q.

For slot i = 1..k (block row i, at position s+i), with unary logits z_i and final hidden h_i::

    C_i = ids of the K_sel largest z_i       (logit descending, token id ascending on ties)
    U_i = z_i[C_i]                           [K_sel]
    g_i = P h_i                              [r]      P = candidate_selector.hidden_projection
    S_i(a -> b) = U_i[b] + < A[a] * g_i , Bc[b] >    A predecessor, Bc successor codebook [V, r]

Walk from y_0 = t0 (the anchor): sigma_i = S_i(y_{i-1} -> C_i[j]) for j < K_sel.
Greedy: j* = argmax_j sigma_i (lowest index on ties). Sampled at temperature T:
q_i = softmax(sigma_i / T) in fp32 (temperature only: no top-k or top-p on q), and j* is the
inverse-CDF draw in candidate order with u_i = rng.uniform(seed, s, Purpose.SELECTOR, i), the
project's one draw rule (``sampling.sample_from_probs``): the smallest j with
cumsum(q_i)[j] > u_i * sum(q_i) (fp64), never a candidate with q = 0. Either way y_i = C_i[j*].
As a distribution over the vocabulary q_i has support within C_i and is conditional on the
realised path y_{<i}. The forward ran all S rows; the walk stops after k.

Checked against public sources: z-lab/dflash ``dflash/model_mlx.py`` ``CandidateSelector.select``
(top-k of the logits, unary = their logits, edges = sum(pred[prev] * proj(h) * succ[cand]),
softmax(scores / T) with no top-k/top-p, the predecessor updated to the chosen candidate) and
vLLM ``qwen3_dflash2.py`` (``_score_edges``: ``unary + einsum(pred * hidden, succ)``; top-k
sorted). The candidate order on ties and the inverse-CDF draw are this project's decisions
(facts sheet section 6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..model.draft import DraftBlockOutput
from ..formats.draft_config import DraftConfig
from ..request.rng import Purpose, uniform
from .sampling import sample_from_probs


@dataclass(frozen=True)
class CandidateSelector:
    """The selector's weights and K_sel."""

    hidden_projection: Tensor  # [r, C]
    predecessor_codebook: Tensor  # [V, r]
    successor_codebook: Tensor  # [V, r]
    top_k: int  # K_sel

    @classmethod
    def from_draft(cls, cfg: DraftConfig, weights: Mapping[str, Tensor]) -> CandidateSelector:
        p = "candidate_selector."
        return cls(weights[f"{p}hidden_projection.weight"].float(), weights[f"{p}predecessor_codebook"].float(),
                   weights[f"{p}successor_codebook"].float(), cfg.selector_top_k)


@dataclass(frozen=True)
class SelectorOutput:
    tokens: Tensor  # [k] long: y_1 .. y_k
    cand_ids: Tensor  # [k, K_sel] long: C_i
    draft_probs: Tensor  # [k, K_sel] fp32: q_i over C_i (greedy: one-hot at the pick)
    sigma: Tensor  # [k, K_sel] fp32: the edge scores S_i(y_{i-1} -> C_i[j])


def top_candidates(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """C_i and U_i: the ``top_k`` largest logits, descending, ties by ascending token id.

    logits: ``[V]``. Returns ids ``[K]`` long and their logits ``[K]`` fp32.
    """
    # a stable descending sort keeps equal logits in their original (ascending id) order
    values, ids = torch.sort(logits.float(), descending=True, stable=True)
    return ids[:top_k], values[:top_k]


def edge_scores(selector: CandidateSelector, prev_token: int, projected: Tensor, cand_ids: Tensor,
                unary: Tensor) -> Tensor:
    """sigma[j] = U[j] + sum_r A[prev, r] * g[r] * Bc[C[j], r]. projected: g ``[r]``. Returns ``[K]``."""
    pred = selector.predecessor_codebook[prev_token] * projected  # [r]
    return unary + selector.successor_codebook[cand_ids] @ pred  # [K]


def selector_uniforms(seed: int, anchor_position: int, k: int) -> Tensor:
    """u_i = uniform(seed, s, SELECTOR, i) for slots i = 1..k, fp64 ``[k]`` (the exact values)."""
    return torch.tensor([uniform(seed, anchor_position, Purpose.SELECTOR, i) for i in range(1, k + 1)],
                        dtype=torch.float64)


def select(block: DraftBlockOutput, selector: CandidateSelector, anchor_token: int, k: int,
           temperature: float, uniforms: Sequence[float] | Tensor | None = None) -> SelectorOutput:
    """Walk k slots from the anchor. ``uniforms`` None: greedy (temperature unused); else u_1..u_k."""
    rows = block.logits.shape[0]
    if not 1 <= k <= rows:
        raise ValueError(f"k={k}: expected 1 .. {rows} (the block's draft rows)")
    if uniforms is not None:
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: a sampled walk needs temperature > 0")
        if len(uniforms) != k:
            raise ValueError(f"got {len(uniforms)} uniforms for k={k} slots")
    projected = block.hidden[1:k + 1].float() @ selector.hidden_projection.T  # [k, r]: g_i = P h_i
    tokens, cands, probs, sigmas = [], [], [], []
    prev = anchor_token
    for i in range(1, k + 1):
        cand_ids, unary = top_candidates(block.logits[i - 1], selector.top_k)  # [K], [K]
        sigma = edge_scores(selector, prev, projected[i - 1], cand_ids, unary)  # [K]
        if uniforms is None:
            pick = int(torch.argmax(sigma))  # first maximum: the lowest index on ties
            q = torch.zeros_like(sigma)
            q[pick] = 1.0
        else:
            q = torch.softmax(sigma / temperature, dim=0)
            pick = sample_from_probs(q, float(uniforms[i - 1]))
        prev = int(cand_ids[pick])
        tokens.append(prev)
        cands.append(cand_ids)
        probs.append(q)
        sigmas.append(sigma)
    return SelectorOutput(tokens=torch.tensor(tokens, dtype=torch.long), cand_ids=torch.stack(cands),
                          draft_probs=torch.stack(probs), sigma=torch.stack(sigmas))
