"""The trainable dense Qwen3.5 hybrid target and its MTP head (twin of reference/model/{target,mtp}.py).

Batched over N sequences of equal length T, all starting at position 0, no cache::

    x^0     = E[t]                          [N, T, C]
    x^{l+1} = layer_l(x^l)                  reference/model/layer.py; taps[l] = x^{l+1}
    h       = rmsnorm_final(x^L)            what the LM head reads
    logits  = W_lm h                        [N, T, V]

MTP head (teacher forcing: row p reads the pair (h_p, t_{p+1}) at RoPE position p + offset and
attends causally to the rows <= p of the same call)::

    x  = W_fc [rmsnorm_emb(E[t_{p+1}]) ; rmsnorm_hid(h_p)]     embedding half first
    h' = rmsnorm_mtp(full_attention_layer(x)),   logits' = W_lm h'

Parameter names are the canonical names of reference/formats/weights.py (``lm_head`` is the
embedding when tied), so checkpoints move in and out through :meth:`canonical_state_dict` and
:meth:`from_canonical`. Under bf16 autocast the matmuls run in bf16; norms, the residual
stream, RoPE and the delta rule stay fp32. Nothing in the forward reads a tensor back to the
host, and the only Python loops run over layers and over GDN chunks (never over tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.formats.errors import CheckpointError, ConfigError, RequestError, expect
from dflash2.reference.formats.weights import expected_target_shapes

from .gated_attention import rope_cos_sin
from .rms_norm import RMSNorm
from .target_layer import DecoderLayer

INIT_STD = 0.02
# Projections that write into the residual stream: their init std is divided by sqrt(2 L).
RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class TargetForward:
    logits: Tensor | None  # [N, T, V], None when not asked for
    hidden: Tensor  # [N, T, C] after the final norm (what the LM head reads)
    taps: dict[int, Tensor] = field(default_factory=dict)  # layer l -> [N, T, C] residual stream after layer l


class MTPHead(nn.Module):
    """The ``mtp.*`` tensors: fc, the two pre-fc norms, one full-attention layer, the final norm."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        c = cfg.hidden_size
        self.fc = nn.utils.skip_init(nn.Linear, 2 * c, c, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(c, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(c, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention")])
        self.norm = RMSNorm(c, cfg.rms_norm_eps)


class TrainableTarget(nn.Module):
    """The dense target, and its MTP head iff ``cfg.mtp_num_hidden_layers == 1``; built as ``init_weights(0)``."""

    def __init__(self, cfg: TargetConfig, *, gdn_chunk_size: int = 64):
        super().__init__()
        expect(not cfg.is_moe, ConfigError, "is_moe", cfg.is_moe,
               f"False: TrainableTarget builds dense targets only (model_type {cfg.model_type!r} is MoE)")
        self.cfg = cfg
        self.embed_tokens = nn.utils.skip_init(nn.Embedding, cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, kind, gdn_chunk_size) for kind in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.utils.skip_init(nn.Linear, cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPHead(cfg) if cfg.mtp_num_hidden_layers == 1 else None
        self.init_weights(0)

    # --- forward -------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, *, tap_layers: Sequence[int] = (),
                return_logits: bool = True) -> TargetForward:
        """input_ids ``[N, T]`` at positions 0 .. T-1; ``taps[l]`` for each l in ``tap_layers``."""
        _check_ids("input_ids", input_ids)
        taps_wanted = set(tap_layers)
        for layer in taps_wanted:
            expect(isinstance(layer, int) and 0 <= layer < self.cfg.num_hidden_layers, RequestError, "tap_layers",
                   tuple(tap_layers), f"layer indices in [0, {self.cfg.num_hidden_layers})")
        cos, sin = self._rope(input_ids.shape[1], 0, input_ids.device)
        x = self.embed_tokens(input_ids)  # [N, T, C] fp32
        taps = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin)
            if i in taps_wanted:
                taps[i] = x
        hidden = self.norm(x)  # [N, T, C]
        return TargetForward(logits=self.logits(hidden) if return_logits else None, hidden=hidden, taps=taps)

    def mtp_forward(self, hidden: Tensor, next_ids: Tensor, *, position_offset: int = 0) -> tuple[Tensor, Tensor]:
        """The MTP head over pairs ``(hidden[:, p], next_ids[:, p])`` at RoPE positions ``p + position_offset``.

        hidden: ``[N, T, C]`` target hidden after the final norm (or the MTP's own output when
        chaining); next_ids: ``[N, T]`` the token after each hidden row. Returns
        ``(h' [N, T, C] after mtp.norm, logits [N, T, V])``.
        """
        expect(self.mtp is not None, ConfigError, "mtp_num_hidden_layers", self.cfg.mtp_num_hidden_layers,
               "1 (this target has no MTP head)")
        _check_ids("next_ids", next_ids)
        if hidden.shape != (*next_ids.shape, self.cfg.hidden_size):
            raise RequestError(f"hidden shape {list(hidden.shape)}: expected {[*next_ids.shape, self.cfg.hidden_size]} "
                               "(next_ids [N, T] plus hidden_size)")
        mtp = self.mtp
        e = mtp.pre_fc_norm_embedding(self.embed_tokens(next_ids))  # [N, T, C]
        u = mtp.pre_fc_norm_hidden(hidden)  # [N, T, C]
        x = mtp.fc(torch.cat([e, u], dim=-1))  # [N, T, C]
        cos, sin = self._rope(next_ids.shape[1], position_offset, next_ids.device)
        out = mtp.norm(mtp.layers[0](x, cos, sin))  # [N, T, C]
        return out, self.logits(out)

    def logits(self, hidden: Tensor) -> Tensor:
        """The LM head: ``hidden [..., C] -> [..., V]``."""
        return F.linear(hidden, self.lm_head_weight)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def _rope(self, steps: int, offset: int, device: torch.device) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(steps, offset, self.cfg.rotary_dim, self.cfg.rope_theta, device)

    # --- canonical weights ---------------------------------------------------------------------

    def canonical_state_dict(self) -> dict[str, Tensor]:
        """Every tensor of ``expected_target_shapes(cfg)``, in its order (detached, sharing storage)."""
        own = self.state_dict()
        if self.cfg.tie_word_embeddings:
            own["lm_head.weight"] = own["embed_tokens.weight"]
        return {name: own[name] for name in expected_target_shapes(self.cfg)}

    @classmethod
    def from_canonical(cls, cfg: TargetConfig, weights: Mapping[str, Tensor], *,
                       gdn_chunk_size: int = 64) -> TrainableTarget:
        """A model holding ``weights`` (canonical names, any float dtype; kept as fp32 parameters)."""
        shapes = expected_target_shapes(cfg)
        for name, shape in shapes.items():
            if name not in weights:
                raise CheckpointError(f"tensor {name!r} is missing: expected a tensor of shape {list(shape)}")
            if tuple(weights[name].shape) != tuple(shape):
                raise CheckpointError(f"tensor {name!r} has shape {list(weights[name].shape)}: expected {list(shape)}")
        extra = sorted(set(weights) - set(shapes))
        if extra:
            raise CheckpointError(f"tensors {extra[:5]} are not canonical target tensors of this config")
        if cfg.tie_word_embeddings and not torch.equal(weights["lm_head.weight"], weights["embed_tokens.weight"]):
            raise CheckpointError("tensor 'lm_head.weight' differs from 'embed_tokens.weight': expected them equal "
                                  "(tie_word_embeddings=True)")
        model = cls(cfg, gdn_chunk_size=gdn_chunk_size)
        own = model.state_dict()
        with torch.no_grad():
            for name in own:
                own[name].copy_(weights[name])
        return model

    # --- training init -------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Redraw every parameter from ``seed`` (a CPU generator, canonical order: device-independent).

        Matrices and the embedding ``N(0, 0.02^2)``; residual outputs (o_proj, out_proj,
        down_proj, the MTP layer's too) divided by ``sqrt(2 L)``; zero-centred norms 0; the GDN
        output norm 1; GDN ``dt_bias = 1`` and ``A_log = log U(0.01, 16)`` (transformers'
        Qwen3.5 init); conv1d as torch's Conv1d default, ``U(+-1/sqrt(K))`` (fan_in = K, depthwise).
        """
        gen = torch.Generator().manual_seed(seed)
        own = self.state_dict()
        for name, shape in expected_target_shapes(self.cfg).items():
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            own[name].copy_(_init_tensor(name, shape, gen, self.cfg.num_hidden_layers))


def _init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, num_layers: int) -> Tensor:
    """One canonical tensor's training init (see :meth:`TrainableTarget.init_weights`)."""
    if name.endswith("linear_attn.A_log"):
        return (0.01 + (16.0 - 0.01) * torch.rand(shape, generator=gen)).log()
    if name.endswith(("linear_attn.dt_bias", "linear_attn.norm.weight")):
        return torch.ones(shape)
    if len(shape) == 1:  # every other vector is a zero-centred norm weight (mtp.pre_fc_norm_* included)
        return torch.zeros(shape)
    if name.endswith("linear_attn.conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return (2.0 * torch.rand(shape, generator=gen) - 1.0) * bound
    std = INIT_STD / math.sqrt(2 * num_layers) if name.endswith(RESIDUAL_OUTPUTS) else INIT_STD
    return torch.randn(shape, generator=gen) * std


def _check_ids(field_name: str, ids: Tensor) -> None:
    """Shape and dtype only: a range check would read the ids back to the host (the embedding checks them)."""
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise RequestError(f"{field_name} shape {list(ids.shape)} dtype {ids.dtype}: expected a non-empty "
                           "[N, T] integer tensor")
