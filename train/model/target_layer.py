"""One batched pre-norm decoder layer of the dense Qwen3.5 hybrid (twin of reference/model/layer.py, mlp.py).

    x = x + mixer(rmsnorm_in(x))        mixer: GatedDeltaNet (linear_attention) or GatedAttention
    x = x + mlp(rmsnorm_post(x))        mlp: SwiGLU, W_down (silu(W_gate u) * W_up u)

Parameter names follow the canonical layout (``input_layernorm``, ``linear_attn`` or ``self_attn``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``), so a stack of these under
``layers.{i}.`` has exactly the canonical state-dict names.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.reference.formats.config import LAYER_TYPES, TargetConfig

from .gated_attention import GatedAttention
from .gdn import GatedDeltaNet
from .rms_norm import RMSNorm


class SwiGLU(nn.Module):
    """The dense MLP: ``W_down (silu(W_gate x) * (W_up x))``, ``[N, T, C] -> [N, T, C]``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.utils.skip_init(nn.Linear, hidden, intermediate, bias=False)
        self.up_proj = nn.utils.skip_init(nn.Linear, hidden, intermediate, bias=False)
        self.down_proj = nn.utils.skip_init(nn.Linear, intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One decoder layer of kind ``layer_type`` ('linear_attention' or 'full_attention')."""

    def __init__(self, cfg: TargetConfig, layer_type: str, chunk_size: int = 64):
        super().__init__()
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type={layer_type!r}: expected one of {LAYER_TYPES}")
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg, chunk_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: ``[N, T, C]`` residual stream; cos, sin ``[T, rd/2]`` (read by attention only). Returns ``[N, T, C]``."""
        h = self.input_layernorm(x)
        if self.layer_type == "full_attention":
            x = x + self.self_attn(h, cos, sin)
        else:
            x = x + self.linear_attn(h)
        return x + self.mlp(self.post_attention_layernorm(x))
