"""One pre-norm residual decoder layer over token-major rows (twin of reference/model/layer.py).

    x = x + mixer(rmsnorm_in(x))        Gated DeltaNet (state slots) or gated full attention (paged K/V)
    x = x + mlp(rmsnorm_post(x))        dense SwiGLU or sparse MoE

Each residual add is fused with the norm that reads its sum (:func:`add_rms_norm`): the mixer's into
``rmsnorm_post``, the MLP's into the next layer's ``rmsnorm_in`` (or the final norm), so a stack
runs :meth:`FastDecoderLayer.forward_deferred`, which hands its last add on to the next layer.

Under tensor parallelism (``tp``, fast/parallel/) the mixer and the MLP each end in a row-parallel
projection, so their outputs are per-rank partial sums: the layer all-reduces each before its residual
add (two all-reduces per layer). At tp=1 ``all_reduce`` is the identity and nothing changes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from .attention import FastAttention
from .gdn import FastGDN
from .mlp import FastMLP
from .moe import FastMoE
from ..kernels.dense.rms_norm import add_rms_norm
from ..kernels.dense.skinny_linear import skinny_linear
from ..kernels.quant.quant_linear import dequantize_op
from ..kernels.quant.quant_matmul import quant_matmul
from ..parallel.group import TPGroup
from .params import Params, zero_centred_scale
from .pools import GDNSlots, PagedKV
from .step import StepMeta


class FastDecoderLayer:
    def __init__(self, cfg: TargetConfig, params: Params, prefix: str, layer_type: str, tp: TPGroup | None = None):
        """``cfg``: the rank's config view (``fast/parallel/plan.rank_config``; the full config at tp=1)."""
        self.cfg = cfg
        self.tp = tp or TPGroup.single()
        self.dtype = params.dtype
        self.layer_type = layer_type
        self.input_scale = zero_centred_scale(params.get(f"{prefix}input_layernorm.weight", torch.float32))
        self.post_scale = zero_centred_scale(params.get(f"{prefix}post_attention_layernorm.weight", torch.float32))
        if layer_type == "full_attention":
            self.mixer: FastAttention | FastGDN = FastAttention(cfg, params, prefix)
        else:
            self.mixer = FastGDN(cfg, params, prefix)
        self.mlp: FastMoE | FastMLP = FastMoE(cfg, params, prefix) if cfg.is_moe else FastMLP(params, prefix)
        quant_ops = (quant_matmul, dequantize_op) if params.quantized else ()  # a GGUF target's projections
        # the kernel ops it runs (the projections: linear.py's skinny_linear, or the quantized ones)
        self.ops = (add_rms_norm, skinny_linear, *self.mixer.ops, *self.mlp.ops, *quant_ops)

    def forward(self, x: Tensor, meta: StepMeta, state: PagedKV | GDNSlots) -> Tensor:
        """x: ``[N, C]`` residual rows. Returns the new residual ``[N, C]``."""
        x, update = self.forward_deferred(x, None, meta, state)
        return x + update

    def forward_deferred(self, x: Tensor, pending: Tensor | None, meta: StepMeta,
                         state: PagedKV | GDNSlots) -> tuple[Tensor, Tensor]:
        """The layer with its last residual add left to the caller.

        x, pending: ``[N, C]``; the layer's input residual is ``x + pending`` (``pending`` None: x).
        Returns ``(x', update)``, the residual after the mixer and the MLP's output, whose sum
        ``x' + update`` is the layer's output residual.
        """
        eps = self.cfg.rms_norm_eps
        x, h = add_rms_norm(x, pending, self.input_scale, eps, self.dtype)
        mixed = self.tp.all_reduce(self.mixer.forward(h, meta, state))  # row-parallel partials summed (tp > 1)
        x, h = add_rms_norm(x, mixed, self.post_scale, eps, self.dtype)
        return x, self.tp.all_reduce(self.mlp.forward(h))
