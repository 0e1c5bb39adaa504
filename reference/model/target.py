"""The whole Qwen3.5 hybrid text model (dense or MoE): the target of speculative decoding.

For tokens ``t_0 .. t_{T-1}`` at absolute positions ``n .. n+T-1`` (n tokens already in the
cache)::

    x^0     = E[t]                                   embedding rows           [T, C]
    x^{l+1} = layer_l(x^l)                           l = 0 .. L-1, reference/model/layer.py
    h       = rmsnorm_final(x^L)                     zero-centred             [T, C]
    logits  = W_lm h                                                          [T, V]

``taps[l] = x^{l+1}``, the residual stream after layer l (HF ``hidden_states[l + 1]``; HF's last
entry is ``h`` instead, after the final norm). These are the rows a DFlash draft reads.

The cache is explicit: per layer a :class:`GDNState` (linear attention) or a :class:`KVCache`
(full attention), plus ``length``. One call over T tokens and T calls of one token give the same
numbers (the tests hold them to it). Everything is fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..formats.config import TargetConfig
from ..formats.errors import CheckpointError, RequestError
from .layer import DecoderLayer, LayerState
from .norm import rms_norm
from ..formats.weights import Shape, expected_target_shapes


def take_weights(weights: Mapping[str, Tensor], shapes: Mapping[str, Shape]) -> dict[str, Tensor]:
    """The named tensors as fp32, refusing a missing or misshaped one with a :class:`CheckpointError`."""
    taken = {}
    for name, shape in shapes.items():
        if name not in weights:
            raise CheckpointError(f"tensor {name!r} is missing: expected a tensor of shape {list(shape)}")
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {list(tensor.shape)}: expected {list(shape)}")
        taken[name] = tensor.detach().to(torch.float32)
    return taken


@dataclass
class TargetCache:
    """Everything the target remembers about the tokens it has seen."""

    layers: list[LayerState]  # one per decoder layer
    length: int = 0  # tokens seen; the next token sits at this position

    def clone(self) -> TargetCache:
        return TargetCache(layers=[state.clone() for state in self.layers], length=self.length)


@dataclass(frozen=True)
class TargetOutput:
    logits: Tensor  # [T, V]
    hidden: Tensor  # [T, C] after the final norm (what the LM head reads)
    taps: tuple[Tensor, ...]  # L tensors [T, C]: residual stream after each layer


class ReferenceTarget:
    """The fp32 reference target, built from canonical tensor names (reference/formats/weights.py)."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor]):
        shapes = {name: shape for name, shape in expected_target_shapes(cfg).items() if not name.startswith("mtp.")}
        w = take_weights(weights, shapes)
        self.cfg = cfg
        self.embed = w["embed_tokens.weight"]  # [V, C]
        self.final_norm = w["norm.weight"]  # [C]
        self.lm_head = w["lm_head.weight"]  # [V, C]
        self.layers = [DecoderLayer(cfg, w, f"layers.{i}.", kind) for i, kind in enumerate(cfg.layer_types)]

    def new_cache(self) -> TargetCache:
        return TargetCache(layers=[layer.new_state() for layer in self.layers])

    def forward(self, token_ids: Tensor, cache: TargetCache | None = None) -> TargetOutput:
        """Run ``token_ids [T]`` at positions ``cache.length ..``; ``cache`` is updated in place."""
        check_token_ids(token_ids, self.cfg.vocab_size)
        cache = self.new_cache() if cache is None else cache
        positions = torch.arange(cache.length, cache.length + token_ids.shape[0])  # [T]
        x = self.embed[token_ids]  # [T, C]
        taps = []
        for layer, state in zip(self.layers, cache.layers, strict=True):
            x = layer.forward(x, positions, state)
            taps.append(x)
        cache.length += token_ids.shape[0]
        hidden = rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)  # [T, C]
        return TargetOutput(logits=hidden @ self.lm_head.T, hidden=hidden, taps=tuple(taps))


def check_token_ids(token_ids: Tensor, vocab_size: int) -> None:
    """Refuse anything but a non-empty 1-D integer tensor of ids in ``[0, vocab_size)``."""
    if token_ids.ndim != 1 or token_ids.shape[0] == 0 or token_ids.is_floating_point():
        raise RequestError(f"token_ids shape {list(token_ids.shape)} dtype {token_ids.dtype}: expected a non-empty "
                           "1-D integer tensor")
    if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
        raise RequestError(f"token_ids range [{int(token_ids.min())}, {int(token_ids.max())}]: expected ids in "
                           f"[0, {vocab_size})")

