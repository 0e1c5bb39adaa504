"""The multi-token-prediction (MTP) head that Qwen3.5 checkpoints ship as ``mtp.*`` tensors.

transformers ignores these tensors; the structure below is taken from the serving engines that
run them. The head reads a pair (h_p, t_{p+1}): the target's hidden state at position p and the
token that follows it, and predicts t_{p+2}::

    e      = rmsnorm_emb(E[t_{p+1}])                       shared target embedding, zero-centred norm
    u      = rmsnorm_hid(h_p)
    x      = W_fc [e ; u]                                  fc [C, 2C], embedding half first
    x      = decoder_layer(x) at RoPE position p           one full-attention layer, own KV cache,
                                                           the target's MLP kind (MoE for MoE targets)
    h'     = rmsnorm_mtp(x)                                mtp.norm
    logits = W_lm h'                                       the target's LM head

Findings, with sources (public code; facts only, nothing copied):

(a) ``h_p`` is the target's hidden state after its final norm: the tensor the target's LM head
    reads. vLLM's target ``Qwen3_5ForCausalLMBase.forward`` returns the model output that
    ``compute_logits`` feeds straight into ``lm_head`` (vllm/model_executor/models/qwen3_5.py),
    and that same tensor is what the proposer receives as ``target_hidden_states``.
(b) The pair (h_p, t_{p+1}) sits at position p. vLLM's proposer ``set_inputs_first_pass``
    (vllm/v1/spec_decode/llm_base_proposer.py) shifts the input ids left by one (the sampled next
    token fills the last slot) and keeps ``target_positions`` unchanged.
(c) Chained steps feed the MTP's own output back: step j+1 takes the hidden state the MTP
    returned at step j (``h'``, after ``mtp.norm``, the same tensor its logits were computed from,
    since Qwen3.5 MTP returns a single tensor) with the token drafted at step j, at position
    p + j + 1, appending to the same MTP KV cache (llm_base_proposer.py ``propose``).
Structure: vllm/model_executor/models/qwen3_5_mtp.py (``Qwen3_5MultiTokenPredictor.forward``:
pre_fc_norm_embedding, pre_fc_norm_hidden, ``cat([embeds, hidden])``, fc, a decoder layer built
with ``layer_type="full_attention"`` from the text config, norm; ``Qwen3_5MoeMTP`` for MoE) and
sgl-project/sglang python/sglang/srt/models/qwen3_next_mtp.py (``Qwen3NextForCausalLMMTP``: the
same order, the layer as a one-layer model with ``full_attention_interval = 1``).

The MTP cache therefore lags the target by one position: after the target has seen tokens
``t_0 .. t_n`` and the next token ``t_{n+1}`` is known, the MTP has consumed the pairs for
positions ``0 .. n-1``; the pair at n, ``(h_n, t_{n+1})``, is the first step of the next draft
chain (:func:`greedy_chain`) and stays cached. Rolling back rejected drafts is
:meth:`MTPCache.truncate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .attention import KVCache
from ..formats.config import TargetConfig
from ..formats.errors import ConfigError, expect
from .layer import DecoderLayer
from .norm import rms_norm
from .target import check_token_ids, take_weights
from ..formats.weights import expected_target_shapes


@dataclass
class MTPCache:
    """The MTP layer's own KV cache; ``length`` pairs seen, the next pair sits at that position."""

    kv: KVCache

    @property
    def length(self) -> int:
        return self.kv.length

    def clone(self) -> MTPCache:
        return MTPCache(kv=self.kv.clone())

    def truncate(self, length: int) -> None:
        """Forget the pairs at positions ``length`` and later."""
        self.kv.truncate(length)


class MTPOutput(NamedTuple):
    logits: Tensor  # [T, V]
    hidden: Tensor  # [T, C] after mtp.norm: the hidden state to chain into the next step


class ReferenceMTP:
    """The fp32 reference MTP head, built from canonical names (``mtp.*`` plus embedding and LM head)."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor]):
        expect(cfg.mtp_num_hidden_layers == 1, ConfigError, "mtp_num_hidden_layers", cfg.mtp_num_hidden_layers,
               "1 (this target has no MTP head)")
        shapes = {name: shape for name, shape in expected_target_shapes(cfg).items()
                  if name.startswith("mtp.") or name in ("embed_tokens.weight", "lm_head.weight")}
        w = take_weights(weights, shapes)
        self.cfg = cfg
        self.embed = w["embed_tokens.weight"]  # [V, C]
        self.lm_head = w["lm_head.weight"]  # [V, C]
        self.fc = w["mtp.fc.weight"]  # [C, 2C]
        self.norm_embedding = w["mtp.pre_fc_norm_embedding.weight"]  # [C]
        self.norm_hidden = w["mtp.pre_fc_norm_hidden.weight"]  # [C]
        self.final_norm = w["mtp.norm.weight"]  # [C]
        self.layer = DecoderLayer(cfg, w, "mtp.layers.0.", "full_attention")

    def new_cache(self) -> MTPCache:
        return MTPCache(kv=KVCache.empty(self.cfg))

    def forward(self, hidden: Tensor, next_token_ids: Tensor, cache: MTPCache | None = None) -> MTPOutput:
        """Pairs ``(hidden[i], next_token_ids[i])`` at positions ``cache.length + i``; cache updated in place.

        hidden: ``[T, C]`` target hidden states after the final norm (or, when chaining, the
        MTP's own ``hidden`` output); next_token_ids: ``[T]`` the token after each hidden row.
        """
        check_token_ids(next_token_ids, self.cfg.vocab_size)
        cache = self.new_cache() if cache is None else cache
        eps = self.cfg.rms_norm_eps
        positions = torch.arange(cache.length, cache.length + next_token_ids.shape[0])  # [T]
        e = rms_norm(self.embed[next_token_ids], self.norm_embedding, eps)  # [T, C]
        u = rms_norm(hidden, self.norm_hidden, eps)  # [T, C]
        x = torch.cat([e, u], dim=-1) @ self.fc.T  # [T, C]
        x = self.layer.forward(x, positions, cache.kv)  # [T, C]
        out = rms_norm(x, self.final_norm, eps)  # [T, C]
        return MTPOutput(logits=out @ self.lm_head.T, hidden=out)


def greedy_chain(mtp: ReferenceMTP, hidden: Tensor, next_token: int, cache: MTPCache, k: int) -> list[int]:
    """Draft ``k`` tokens greedily by chaining the MTP on its own output (finding (c)).

    hidden: ``[C]`` the target's final-normed hidden at position p = ``cache.length``;
    next_token: the committed token at p+1. Returns the drafts for positions p+2 ..; the cache
    grows by ``k`` pairs (truncate it back to drop the rejected ones).
    """
    drafts: list[int] = []
    h, token = hidden[None, :], next_token
    for _ in range(k):
        logits, h = mtp.forward(h, torch.tensor([token]), cache)
        token = int(torch.argmax(logits[-1]))
        drafts.append(token)
    return drafts
