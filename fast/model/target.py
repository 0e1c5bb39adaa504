"""The batched Qwen3.5 hybrid target (dense or MoE) over the cache pools (twin of reference/model/target.py).

One :meth:`FastTarget.forward` runs one engine step: the rows of B sequences, token-major
``[N]``, through every layer::

    x^0 = E[t];  x^{l+1} = layer_l(x^l);  h = rmsnorm_final(x^L);  logits = W_lm h[logits_rows]

Full-attention layers write each row's K/V into its paged slot and attend over the sequence's
context; GDN layers continue each sequence from its state slot (a verify step stores the rows'
inputs instead, for the commit to replay the kept ones: see fast/model/pools.py). ``taps`` are the
residual rows after the layers in ``tap_layers``, concatenated in that order (the DFlash draft's
context features).

Compute runs in ``dtype`` (residual stream, matmuls, caches); norms, RoPE, softmax, the router,
the GDN conv and recurrence run in fp32; logits come out fp32.

Tensor parallelism (``tp``, a :class:`~dflash2.fast.parallel.TPGroup` of size > 1; fast/parallel/): every rank
builds its own FastTarget from the full canonical tensors, cut for its rank (:class:`Params` with ``tp``), with
the rank's heads and intermediate sizes (``local_cfg``) and its cache pools built from ``local_cfg``
(its KV heads, its GDN heads). Each rank runs the same batch: the embedding is vocabulary-parallel (a masked
lookup, all-reduced), each layer all-reduces its mixer's and its MLP's row-parallel outputs, and the LM head
computes the rank's vocabulary slice, all-gathered, so every rank returns the full logits, hidden and taps.

A CUDA-graph capture of a step is cut into graphs between layers (``capture.layer_cuts``), so the
host launches the next while the GPU runs the last (fast/model/capture.py); eagerly it changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from .batch import ForwardBatch
from .capture import graph_cut, layer_cuts
from .layer import FastDecoderLayer
from ..kernels.attention.rope import inv_freq
from ..kernels.dense.rms_norm import add_rms_norm
from ..parallel.group import TPGroup
from ..parallel.vocab import parallel_embed, parallel_lm_head
from .linear import linear
from .params import Params, zero_centred_scale
from .pools import CachePools
from .step import StepMeta


@dataclass(frozen=True)
class FastOutput:
    logits: Tensor  # [M, V] fp32, for batch.logits_rows
    hidden: Tensor  # [N, C] after the final norm (what the LM head and the MTP head read)
    taps: Tensor  # [N, len(tap_layers) * C] residual after each tapped layer, in tap order
    meta: StepMeta | None = None  # the step's layout as the forward derived it (the verify commit reuses it)


class FastTarget:
    """The fast target, built from canonical tensors (``dflash2.reference.formats.checkpoint.load_target``)."""

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, Tensor], dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", tap_layers: tuple[int, ...] = (), tp: TPGroup | None = None):
        for layer in tap_layers:
            if not 0 <= layer < cfg.num_hidden_layers:
                raise ValueError(f"tap layer {layer}: expected a layer index in [0, {cfg.num_hidden_layers})")
        self.tp = tp or TPGroup.single()
        params = Params(cfg, weights, dtype, device, self.tp)  # serves the rank's parts (tp > 1)
        # cfg: the model's (hidden size, vocabulary, layers); local_cfg: this rank's heads and widths, which the
        # layers and the cache pools use (the same object at tp=1)
        self.cfg, self.local_cfg, self.dtype, self.device = cfg, params.cfg, dtype, params.device
        self.tap_layers = tuple(tap_layers)
        self.last_tap = max(self.tap_layers, default=-1)  # where forward's on_taps fires
        self.embed = params.get("embed_tokens.weight")  # [V/tp, C]
        self.lm_head = params.weight("lm_head.weight")  # [V/tp, C] (the embedding when tied; a GGUF's kept quantized)
        self.final_scale = zero_centred_scale(params.get("norm.weight", torch.float32))  # [C]
        inv_freq(cfg.rotary_dim, cfg.rope_theta, self.device)  # every step's RoPE reads it: made here, not in a capture
        self.layers = [FastDecoderLayer(self.local_cfg, params, f"layers.{i}.", kind, self.tp)
                       for i, kind in enumerate(cfg.layer_types)]

    def capturable(self) -> bool:
        """Whether a step of this target can be captured in a CUDA graph: on CUDA, and every kernel op its layers
        run says so (``KernelOp.capturable``: e.g. the MoE experts' torch twin reads counts on the host)."""
        return self.device.type == "cuda" and all(op.capturable(self.device) for layer in self.layers
                                                  for op in layer.ops)

    def forward(self, batch: ForwardBatch, pools: CachePools,
                on_taps: Callable[[Tensor], None] | None = None) -> FastOutput:
        """One step over ``batch`` (tensors on the model's device); updates ``pools`` in place.

        ``on_taps``, if given, is called with the taps ``[N, len(tap_layers) * C]`` once the last tapped
        layer has written them, before the layers after it run (a verify step forks its observe there,
        ``fast/model/side_stream.py``); the same tensor is the output's ``taps``."""
        if on_taps is not None and not self.tap_layers:
            raise ValueError("on_taps given to a target with no tap_layers: it would never be called")
        meta = StepMeta.build(batch, pools)
        hidden_size = self.cfg.hidden_size
        tp = self.tp
        x = parallel_embed(self.embed, batch.token_ids, tp) if tp.parallel else self.embed[batch.token_ids]  # [N, C]
        pending = None  # the last layer's MLP output, added to x by the next norm (layer.forward_deferred)
        taps = x.new_empty(x.shape[0], len(self.tap_layers) * hidden_size)
        cuts = layer_cuts(len(self.layers))
        for i, layer in enumerate(self.layers):
            if i in cuts:
                graph_cut()  # a captured step continues in its next graph (fast/model/capture.py)
            state = pools.attention[i] if layer.layer_type == "full_attention" else pools.gdn[i]
            x, pending = layer.forward_deferred(x, pending, meta, state)
            if i in self.tap_layers:
                x, pending = x + pending, None
                for j, tapped in enumerate(self.tap_layers):
                    if tapped == i:
                        taps[:, j * hidden_size:(j + 1) * hidden_size] = x
                if on_taps is not None and i == self.last_tap:
                    on_taps(taps)
        _, hidden = add_rms_norm(x, pending, self.final_scale, self.cfg.rms_norm_eps, self.dtype)  # [N, C]
        if tp.parallel:
            logits = parallel_lm_head(hidden[batch.logits_rows], self.lm_head, tp)  # [M, V], every rank
        else:
            logits = linear(hidden[batch.logits_rows], self.lm_head).float()  # [M, V]
        return FastOutput(logits=logits, hidden=hidden, taps=taps, meta=meta)
