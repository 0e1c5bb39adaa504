"""The sparse mixture-of-experts MLP of the Qwen3.5 MoE models, with its gated shared expert.

For a token x (``[C]``), E routed experts of width I, top-k routing::

    probs        = softmax(W_router x)                       [E], fp32
    top          = the k experts with the largest probs      (torch.topk on probs, see below)
    w_e          = probs_e / sum_{e' in top} probs_e'        renormalised over the chosen k
    expert_e(x)  = W_down[e] (silu(W_gate[e] x) * (W_up[e] x))
    y            = sum_{e in top} w_e expert_e(x) + sigmoid(w_sg . x) * swiglu_shared(x)

Expert weights come fused: ``gate_up_proj [E, 2I, C]`` (rows 0..I-1 are W_gate[e], rows I..2I-1
W_up[e]) and ``down_proj [E, C, I]``.

Tie-breaking: the choice is ``torch.topk`` over the fp32 probabilities, as in transformers, so
both pick the same experts for the same probabilities on the same device. torch does not define
which of several exactly equal probabilities wins (on CPU it is not always the lowest index), so
exact ties are outside the contract; with real router weights they do not occur.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ..formats.config import TargetConfig
from .mlp import swiglu


def route(x: Tensor, w_router: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Router: the chosen experts and their renormalised weights.

    x: ``[T, C]``; w_router: ``[E, C]``. Returns ``(expert_ids [T, k] int64, weights [T, k] fp32)``.
    """
    probs = torch.softmax((x @ w_router.T).float(), dim=-1)  # [T, E]
    top_probs, expert_ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    return expert_ids, top_probs / top_probs.sum(dim=-1, keepdim=True)


def routed_experts(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """The weighted sum of each token's chosen experts: ``sum_j weights[t, j] expert_{expert_ids[t, j]}(x_t)``.

    x: ``[T, C]``; expert_ids: ``[T, k]`` (a token's k experts distinct); weights: ``[T, k]``;
    gate_up: ``[E, 2I, C]``; down: ``[E, C, I]``. Returns ``[T, C]`` in x's dtype.
    """
    width = gate_up.shape[1] // 2
    routed = torch.zeros_like(x)  # [T, C]
    for e in range(gate_up.shape[0]):
        tokens, slots = torch.nonzero(expert_ids == e, as_tuple=True)  # each token at most once
        if tokens.numel():
            w_gate, w_up = gate_up[e, :width], gate_up[e, width:]  # [I, C] each
            routed[tokens] += weights[tokens, slots, None] * swiglu(x[tokens], w_gate, w_up, down[e])  # [N, C]
    return routed


class SparseMoE:
    """The MoE sublayer, reading ``{prefix}mlp.*`` (router, fused experts, shared expert)."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], prefix: str):
        p = f"{prefix}mlp."
        self.top_k = cfg.num_experts_per_tok
        self.w_router = weights[f"{p}gate.weight"]  # [E, C]
        self.gate_up = weights[f"{p}experts.gate_up_proj"]  # [E, 2I, C]
        self.down = weights[f"{p}experts.down_proj"]  # [E, C, I]
        self.shared_gate = weights[f"{p}shared_expert.gate_proj.weight"]  # [Is, C]
        self.shared_up = weights[f"{p}shared_expert.up_proj.weight"]  # [Is, C]
        self.shared_down = weights[f"{p}shared_expert.down_proj.weight"]  # [C, Is]
        self.shared_expert_gate = weights[f"{p}shared_expert_gate.weight"]  # [1, C]

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[T, C]`` (after post_attention_layernorm). Returns ``[T, C]``."""
        expert_ids, weights = route(x, self.w_router, self.top_k)  # [T, k], [T, k]
        routed = routed_experts(x, expert_ids, weights, self.gate_up, self.down)  # [T, C]
        shared = torch.sigmoid(x @ self.shared_expert_gate.T) * swiglu(
            x, self.shared_gate, self.shared_up, self.shared_down)  # [T, C]
        return routed + shared
