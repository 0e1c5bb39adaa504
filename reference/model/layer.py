"""One pre-norm residual decoder layer of a Qwen3.5 hybrid (also the MTP head's layer).

    x = x + mixer(rmsnorm_in(x))        mixer: Gated DeltaNet or gated full attention
    x = x + mlp(rmsnorm_post(x))        mlp: dense SwiGLU or sparse MoE (the model's kind)

Both norms are zero-centred RMSNorms. The layer's memory is a :class:`GDNState` for a
linear-attention layer and a :class:`KVCache` for a full-attention layer.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from .attention import GatedAttention, KVCache
from ..formats.config import TargetConfig
from .gdn import GatedDeltaNet, GDNState
from .mlp import DenseMLP
from .moe import SparseMoE
from .norm import rms_norm

LayerState = GDNState | KVCache


class DecoderLayer:
    """Reads ``{prefix}input_layernorm``, ``{prefix}post_attention_layernorm``, the mixer and the MLP."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], prefix: str, layer_type: str):
        self.cfg = cfg
        self.layer_type = layer_type
        self.input_norm = weights[f"{prefix}input_layernorm.weight"]  # [C]
        self.post_norm = weights[f"{prefix}post_attention_layernorm.weight"]  # [C]
        if layer_type == "full_attention":
            self.mixer: GatedAttention | GatedDeltaNet = GatedAttention(cfg, weights, prefix)
        else:
            self.mixer = GatedDeltaNet(cfg, weights, prefix)
        self.mlp: SparseMoE | DenseMLP = (SparseMoE if cfg.is_moe else DenseMLP)(cfg, weights, prefix)

    def new_state(self) -> LayerState:
        return KVCache.empty(self.cfg) if self.layer_type == "full_attention" else GDNState.zeros(self.cfg)

    def forward(self, x: Tensor, positions: Tensor, state: LayerState) -> Tensor:
        """x: ``[T, C]`` residual stream at ``positions [T]``. Returns the new residual ``[T, C]``."""
        h = rms_norm(x, self.input_norm, self.cfg.rms_norm_eps)
        if isinstance(self.mixer, GatedAttention):
            x = x + self.mixer.forward(h, positions, state)
        else:
            x = x + self.mixer.forward(h, state)
        return x + self.mlp.forward(rms_norm(x, self.post_norm, self.cfg.rms_norm_eps))
