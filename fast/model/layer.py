"""One pre-norm residual decoder layer over token-major rows (twin of reference/model/layer.py).

    x = x + mixer(rmsnorm_in(x))        Gated DeltaNet (state slots) or gated full attention (paged K/V)
    x = x + mlp(rmsnorm_post(x))        dense SwiGLU or sparse MoE
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from .attention import FastAttention
from .gdn import FastGDN
from .mlp import FastMLP
from .moe import FastMoE
from .norm import rms_norm, zero_centred_scale
from .ops import ModelOps
from .params import Params
from .pools import GDNSlots, PagedKV
from .step import StepMeta


class FastDecoderLayer:
    def __init__(self, cfg: TargetConfig, params: Params, prefix: str, layer_type: str, ops: ModelOps):
        self.cfg = cfg
        self.dtype = params.dtype
        self.layer_type = layer_type
        self.input_scale = zero_centred_scale(params.get(f"{prefix}input_layernorm.weight", torch.float32))
        self.post_scale = zero_centred_scale(params.get(f"{prefix}post_attention_layernorm.weight", torch.float32))
        if layer_type == "full_attention":
            self.mixer: FastAttention | FastGDN = FastAttention(cfg, params, prefix, ops.paged_attention)
        else:
            self.mixer = FastGDN(cfg, params, prefix, ops.causal_conv1d, ops.gated_delta_rule)
        self.mlp: FastMoE | FastMLP = FastMoE(cfg, params, prefix, ops.moe_experts) if cfg.is_moe else FastMLP(
            params, prefix)

    def forward(self, x: Tensor, meta: StepMeta, state: PagedKV | GDNSlots) -> Tensor:
        """x: ``[N, C]`` residual rows. Returns the new residual ``[N, C]``."""
        eps = self.cfg.rms_norm_eps
        x = x + self.mixer.forward(rms_norm(x, self.input_scale, eps, self.dtype), meta, state)
        return x + self.mlp.forward(rms_norm(x, self.post_scale, eps, self.dtype))
