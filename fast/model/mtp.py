"""The batched MTP head over its own paged K/V (twin of reference/model/mtp.py).

Each row is a pair (h_p, t_{p+1}) at position p: the target's final-normed hidden at p (or, when
chaining, the MTP's own output hidden) and the token after it::

    x      = W_fc [rmsnorm_emb(E[t_{p+1}]) ; rmsnorm_hid(h_p)]
    x      = decoder_layer(x) at position p     one full-attention layer over ``pools.mtp``
    h'     = rmsnorm_mtp(x);   logits = W_lm h'

The batch is a :class:`ForwardBatch` whose ``token_ids`` are the next tokens ``t_{p+1}`` and whose
``positions`` are the pair positions p; its ``kv_slot_mapping``, ``block_tables`` and
``context_lens`` address the MTP's K/V, which uses the target's page tables (slot(p) for the pair
at p, see fast/model/pools.py for the one-position lag). GDN fields are unused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.formats.errors import ConfigError, expect

from .batch import ForwardBatch
from .layer import FastDecoderLayer
from ..kernels.dense.rms_norm import rms_norm
from .linear import linear
from .params import Params, zero_centred_scale
from .pools import CachePools
from .step import StepMeta
from .target import FastTarget


class MTPOutput(NamedTuple):
    logits: Tensor  # [M, V] fp32, for batch.logits_rows
    hidden: Tensor  # [N, C] after mtp.norm: what the next chained step reads


class FastMTP:
    """The fast MTP head. With ``target``, it shares that model's embedding and LM head tensors."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", *, target: FastTarget | None = None):
        expect(cfg.mtp_num_hidden_layers == 1, ConfigError, "mtp_num_hidden_layers", cfg.mtp_num_hidden_layers,
               "1 (this target has no MTP head)")
        params = Params(cfg, weights, dtype, device)
        self.cfg, self.dtype, self.device = cfg, dtype, params.device
        if target is not None:
            self.embed, self.lm_head = target.embed, target.lm_head
        else:
            self.embed = params.get("embed_tokens.weight")  # [V, C]
            self.lm_head = params.weight("lm_head.weight")  # [V, C]
        self.fc = params.weight("mtp.fc.weight")  # [C, 2C]
        self.embedding_scale = zero_centred_scale(params.get("mtp.pre_fc_norm_embedding.weight", torch.float32))
        self.hidden_scale = zero_centred_scale(params.get("mtp.pre_fc_norm_hidden.weight", torch.float32))
        self.final_scale = zero_centred_scale(params.get("mtp.norm.weight", torch.float32))
        self.layer = FastDecoderLayer(cfg, params, "mtp.layers.0.", "full_attention")

    def forward(self, hidden: Tensor, batch: ForwardBatch, pools: CachePools) -> MTPOutput:
        """hidden: ``[N, C]``, the pairs' hidden rows; ``batch.token_ids [N]`` the next tokens."""
        if pools.mtp is None:
            raise ValueError("the cache pools hold no MTP K/V (built with mtp=False)")
        meta = StepMeta.build(batch, pools)
        eps = self.cfg.rms_norm_eps
        e = rms_norm(self.embed[batch.token_ids], self.embedding_scale, eps, self.dtype)  # [N, C]
        u = rms_norm(hidden, self.hidden_scale, eps, self.dtype)  # [N, C]
        x = linear(torch.cat([e, u], dim=-1), self.fc)  # [N, C]
        x = self.layer.forward(x, meta, pools.mtp)
        out = rms_norm(x, self.final_scale, eps, self.dtype)  # [N, C]
        return MTPOutput(logits=linear(out[batch.logits_rows], self.lm_head).float(), hidden=out)
