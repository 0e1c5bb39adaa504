"""The DFlash 2 draft forward, batched over requests: twin of ``reference/model/draft.py`` and ``reference/model/conv.py``.

Context side (after every target forward, over the N rows of many requests at once)::

    c_p = RMSNorm_hidden_norm(W_fc F_p)                                   [N, C]
    k_p = RoPE_p(RMSNorm_k_norm(W_K c_p)),  v_p = W_V c_p                 [L, N, Hkv, D]  (what the ring holds)

Block side (``forward_blocks``, B requests at once, S = block_size rows each): rows i = 0..S-1 at
s_b + i with tokens [t0_b, mask x (S-1)], embedded with the target's table; per layer::

    u = RMSNorm_in(x);   u', delta = conv prepare(u)            taps over the block rows only
    q, k, v of u' (per-head RMSNorm, RoPE at s_b + i)
    attention over the ring window of request b (positions s_b-W+1 .. s_b-1, row i reading
              those >= s_b+i-W+1) and all S block rows (non-causal)
    x += conv finish(W_O a, delta)
    u = RMSNorm_post(x); u', delta = prepare(u); x += finish(SwiGLU(u'), delta)

then h = RMSNorm_norm(x) and logits = W_lm^target h for rows 1..S-1. Every RMSNorm of the draft is
Qwen3's ``w * x / rms(x)`` (the weight as stored, not ``1 + w``), in fp32; RoPE is NeoX over the
whole head, in fp32.

Context K/V are batch invariant: a row's keys and values have the same bits whatever other rows
share its call (a verify of 8 rows, a prefill chunk, a restore of 2047 rows), so a ring rebuilt
from the dflash_window equals the live ring bitwise. ``batch_invariant_linear`` gets that from
one fixed GEMM shape: every K_TILE_ROWS-row tile is its own matmul of the same shape. One matmul
over all N rows does not: BLAS picks kernels (gemv, split-K) by N, seen on the CPU (MKL) and on
a Hopper GPU (cuBLAS, where a strided-batched bmm over the tiles also varied with the tile count).

Block-side kernels (each a Triton kernel on CUDA and its torch twin elsewhere, dispatched by its
``KernelOp``, fast/kernels/common/dispatch.py): a conv prepare is
``fast/kernels/draft/dynamic_conv.grouped_dynamic_conv``; each conv finish, its residual add
``x + finish(...)`` and the RMSNorm after it (the post-attention norm, the next layer's input norm, the
final norm) are one ``fast/kernels/draft/conv_finish_norm.conv_finish_norm`` (the stored weight as the
norm's scale), and the first layer's input norm ``fast/kernels/dense/rms_norm.add_rms_norm``; q/k norms
and RoPE are one ``fast/kernels/attention/attention_prologue.draft_qk_norm_rope`` with cos/sin computed
once per ``forward_blocks`` (every layer, q and k, share the positions); the window attention is
``fast/kernels/draft/ring_attention.ring_attention`` (split-window on CUDA), reading each layer's ring
``RingPool.k[layer]``, ``RingPool.v[layer]`` in place.

The GEMMs are 2-D ones over the B*S rows, per layer: the two conv kernel projections
``[2*K*C/G, C]``; q, k and v as one over ``block_qkv_weights[layer]`` ``[(H + 2 Hkv) D, C]`` (q rows,
then that layer's k|v rows of ``context_kv_weight``, copied: the context side keeps its one stacked
matrix, so its batch-invariant GEMM and its bits are unchanged; about 2*Hkv*D*C elements more per
layer), read by the prologue and the attention as head views; o_proj; gate and up as one over
``gate_up[layer]`` ``[2I, C]`` with ``silu(gate) * up`` as its epilogue (fp32, rounded once to the
draft dtype; the torch form is ``swiglu.swiglu_act_torch`` of the GEMM's output); down. Every layer GEMM
and the context side's fc go through ``fast/kernels/dense/skinny_linear.skinny_linear``: its Triton kernel
(some configs prefetching their weight into L2 under the previous kernel) where its sweep measured it
faster than cuBLAS at that shape and row count on that GPU (``skinny_linear.TUNED``: the H200's sweep), cuBLAS
otherwise (on the H200 the 27B draft's q|k|v and o, the 35B-A3B draft's q|k|v past 8 rows; on the H100 every
shape: unswept at 8 rows, none faster at 128). The LM head stays in cuBLAS (it streams its 1 GB at the floor). The
per-name entries of ``self.w`` are views: q_proj into ``block_qkv_weights``, k_proj and v_proj into
``context_kv_weight``, gate_proj and up_proj into ``gate_up``. The logits stay in the draft dtype
(``DraftBlocks.logits``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash2.reference.formats.draft_config import DraftConfig

from ..kernels.attention.attention_prologue import draft_qk_norm_rope
from ..kernels.attention.rope import inv_freq, rope_cos_sin
from ..kernels.dense.rms_norm import add_rms_norm
from ..kernels.draft.context_kv import context_k_norm_rope
from ..kernels.draft.conv_finish_norm import conv_finish_norm
from ..kernels.draft.dynamic_conv import grouped_dynamic_conv
from ..kernels.draft.ring_attention import ring_attention
from ..kernels.dense.skinny_linear import skinny_linear
from .capture import graph_cut, layer_cuts
from .linear import linear

if TYPE_CHECKING:
    from dflash2.fast.speculative.ring import RingPool

K_TILE_ROWS = 256  # rows per fixed-shape GEMM; each tile reads the whole projection weight once
# On the CPU a verify step observes k+1 rows: a 256-row tile would multiply ~30x more padding than
# rows there. Any fixed shape is batch invariant; MKL gives the 16- and 256-row tiles the same bits.
CPU_TILE_ROWS = 16


@dataclass(frozen=True)
class DraftBlocks:
    """One batched draft forward over B blocks of S rows."""

    hidden: Tensor  # [B, S, C] after the final norm (row 0 included), in the draft dtype
    # [B, S-1, V] in the draft dtype, as the LM head GEMM writes it: rows 1..S-1 (slot i is logits[:, i-1]).
    # The selector reads it in place and converts to fp32 exactly (the top-K_sel picks compare the same
    # values; only the gathered candidates' U_i leave as fp32), so no full fp32 copy of the rows is made.
    logits: Tensor


def batch_invariant_linear(x: Tensor, weight: Tensor, tile_rows: int | None = None) -> Tensor:
    """``x @ weight.T`` with each row's bits independent of the other rows  # x [N, C], weight [O, C] -> [N, O].

    The rows are padded to whole tiles and each tile is one matmul [tile_rows, C] x [C, O]: the
    same kernel for every tile of every call, and a GEMM's output row reads its own input row only.
    ``tile_rows`` defaults to the device's fixed tile (``CPU_TILE_ROWS`` on the CPU, else ``K_TILE_ROWS``).
    """
    if tile_rows is None:
        tile_rows = CPU_TILE_ROWS if x.device.type == "cpu" else K_TILE_ROWS
    n = x.shape[0]
    tiles = -(-n // tile_rows)
    if tiles == 0:
        return x.new_zeros((0, weight.shape[0]))
    padded = F.pad(x, (0, 0, 0, tiles * tile_rows - n))
    return torch.cat([padded[i * tile_rows:(i + 1) * tile_rows] @ weight.T for i in range(tiles)])[:n]


class FastDraft:
    """A DFlash 2 draft bound to its target's embedding table and LM head, on one device and dtype."""

    def __init__(self, cfg: DraftConfig, draft_weights: Mapping[str, Tensor], target_embed: Tensor,
                 target_lm_head: Tensor, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        expected = (cfg.vocab_size, cfg.hidden_size)
        for name, t in (("target_embed", target_embed), ("target_lm_head", target_lm_head)):
            if tuple(t.shape) != expected:  # (a QuantParam head, a GGUF target's, has its logical shape)
                raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(expected)} for this draft")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.w = {name: t.to(device=self.device, dtype=dtype) for name, t in draft_weights.items()}
        self.norms = {name: t.to(device=self.device, dtype=torch.float32)  # fp32 scales, applied as stored
                      for name, t in draft_weights.items() if name.endswith("norm.weight")}
        self.embed = target_embed.to(device=self.device, dtype=dtype)  # [V, C]
        self.lm_head = (target_lm_head.to(device=self.device, dtype=dtype) if isinstance(target_lm_head, Tensor)
                        else target_lm_head.to(self.device))  # [V, C], dense or a GGUF target's QuantParam
        # the context K/V projection of every layer as one [L*2*Hkv*D, C] matrix (layer-major, k then v);
        # the k_proj / v_proj entries become views into it
        layers = range(cfg.num_hidden_layers)
        names = [f"layers.{layer}.self_attn.{kv}_proj.weight" for layer in layers for kv in "kv"]
        self.context_kv_weight = torch.cat([self.w[name] for name in names])
        for name, view in zip(names, self.context_kv_weight.split(cfg.num_key_value_heads * cfg.head_dim)):
            self.w[name] = view
        # the block side's q, k and v of a layer as one GEMM over [q rows; k rows; v rows] [(H + 2 Hkv) D, C]:
        # the k|v rows are a copy of the layer's rows of context_kv_weight (which stays one matrix for the
        # batch-invariant context GEMM), the q_proj entry becomes a view into it
        kv_rows = 2 * cfg.num_key_value_heads * cfg.head_dim
        self.block_qkv_weights = []
        for layer, kv in zip(layers, self.context_kv_weight.split(kv_rows)):
            name = f"layers.{layer}.self_attn.q_proj.weight"
            fused = torch.cat([self.w[name], kv])
            self.w[name] = fused[:cfg.num_attention_heads * cfg.head_dim]
            self.block_qkv_weights.append(fused)
        # contiguous [N, K] for skinny_linear (which takes the torch form for any other layout): the conv
        # kernel projections [2*K*C/G, C], down_proj, o_proj and fc
        names = ["fc.weight"] + [f"layers.{layer}.{name}" for layer in layers for name in (
            "attention_conv.kernel_projection.weight", "mlp_conv.kernel_projection.weight", "mlp.down_proj.weight",
            "self_attn.o_proj.weight")]
        for name in names:
            self.w[name] = self.w[name].contiguous()
        # forward_blocks' per-call constants: the row offsets 0..S-1 and which row holds the anchor token
        self.block_offsets = torch.arange(cfg.block_size, device=self.device)  # [S]
        self.anchor_rows = self.block_offsets == 0  # [S] bool
        self.context_inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta, self.device)  # [D/2] fp32, host-computed; the
        # block side's rope_cos_sin reads the same kept tensor
        self.k_norms = torch.stack([self.norms[f"layers.{layer}.self_attn.k_norm.weight"] for layer in layers])
        # gate and up of every layer as one [2I, C] matrix (gate rows first); the per-name entries become views
        self.gate_up = []
        for layer in layers:
            pair = [f"layers.{layer}.mlp.{name}_proj.weight" for name in ("gate", "up")]
            fused = torch.cat([self.w[name] for name in pair])
            self.w[pair[0]], self.w[pair[1]] = fused.split(cfg.intermediate_size)
            self.gate_up.append(fused)

    # -- context side --------------------------------------------------------------------------

    def context_rows(self, features: Tensor) -> Tensor:
        """c = RMSNorm_hidden_norm(W_fc F)  # features [N, m*C] (taps of target_layer_ids, in order) -> [N, C].

        The norm is ``rms_norm.add_rms_norm`` with no update and the stored weight as its scale (Qwen3's
        ``w * x / rms(x)`` in fp32, rounded to the draft dtype): one kernel on CUDA, one program per row.
        """
        expected = self.cfg.num_taps * self.cfg.hidden_size
        if features.dim() != 2 or features.shape[1] != expected:
            raise ValueError(f"features {list(features.shape)}: expected [N, {expected}] (m*C, the taps of "
                             f"target layers {list(self.cfg.target_layer_ids)} concatenated)")
        rows = skinny_linear(features.to(self.dtype), self.w["fc.weight"])  # [N, C]
        return add_rms_norm(rows, None, self.norms["hidden_norm.weight"], self.cfg.rms_norm_eps, self.dtype)[1]

    def context_kv(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Post-RoPE keys and values of context rows, batch invariant.

        rows: ``[N, C]`` at absolute ``positions [N]``. Returns k, v, each contiguous ``[L, N, Hkv, D]``.
        After the batch-invariant GEMM, k_norm, RoPE and the ``[L, N]`` layout are one per-row kernel on
        CUDA (``fast/kernels/draft/context_kv.context_k_norm_rope``, batch invariant too).
        """
        cfg = self.cfg
        n, num_layers, hkv, d = rows.shape[0], cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        kv = batch_invariant_linear(rows.to(self.dtype), self.context_kv_weight).reshape(n, num_layers, 2, hkv, d)
        return context_k_norm_rope(kv, self.k_norms, positions, cfg.rms_norm_eps, self.context_inv_freq)

    # -- the blocks ------------------------------------------------------------------------------

    def _block_norm(self, x: Tensor, name: str) -> Tensor:
        """RMSNorm ``name`` of the block rows ``x [B, S, C]``: one kernel on CUDA (as the context rows' norm)."""
        rows = x.reshape(-1, x.shape[-1])
        return add_rms_norm(rows, None, self.norms[name], self.cfg.rms_norm_eps, self.dtype)[1].view(x.shape)

    def _conv_prepare(self, u: Tensor, name: str) -> tuple[Tensor, Tensor]:
        """Side 0 of conv ``name``: ``(u' [B, S, C], delta [B, S, 2, K, C/G])``."""
        base, proj = self.w[f"{name}.base_kernel"], self.w[f"{name}.kernel_projection.weight"]
        b, s, c = u.shape
        taps = self.cfg.conv_kernel_size
        delta = skinny_linear(u.reshape(b * s, c), proj).view(b, s, 2, taps, proj.shape[0] // (2 * taps))
        return grouped_dynamic_conv(u, base[0], delta[:, :, 0], self.cfg.conv_group_size), delta

    def _conv_finish_norm(self, o: Tensor, name: str, delta: Tensor, residual: Tensor,
                          norm: str) -> tuple[Tensor, Tensor]:
        """``x = residual +`` side 1 of conv ``name`` on the sublayer output ``o`` (prepare's delta), and
        RMSNorm ``norm`` of that x: ``(x, u)``, each ``[B, S, C]``; one kernel on CUDA."""
        return conv_finish_norm(o, self.w[f"{name}.base_kernel"][1], delta[:, :, 1], self.cfg.conv_group_size,
                                residual, self.norms[norm], self.cfg.rms_norm_eps, self.dtype)

    def _attention(self, layer: int, u: Tensor, cos: Tensor, sin: Tensor, ring_pool: RingPool, ring_slots: Tensor,
                   anchor_positions: Tensor) -> Tensor:
        """``W_O a`` of the attention sublayer for conv-prepared ``u [B, S, C]``; returns ``[B, S, C]``.

        cos, sin: fp32 ``[B*S, D/2]`` at the rows' positions.
        """
        cfg, w = self.cfg, self.w
        p = f"layers.{layer}.self_attn."
        b, s, c = u.shape
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = skinny_linear(u.reshape(b * s, c), self.block_qkv_weights[layer]).view(b * s, h + 2 * hkv, d)  # [q|k|v]
        q, k = draft_qk_norm_rope(qkv[:, :h], qkv[:, h:h + hkv], self.norms[f"{p}q_norm.weight"],
                                  self.norms[f"{p}k_norm.weight"], cos, sin, cfg.rms_norm_eps)
        a = ring_attention(q, k, qkv[:, h + hkv:], ring_pool.k[layer], ring_pool.v[layer], ring_slots,
                           anchor_positions, cfg.sliding_window)  # [B*S, H, D]
        return skinny_linear(a.reshape(b * s, h * d), w[f"{p}o_proj.weight"]).view(b, s, c)

    def _layer(self, layer: int, x: Tensor, u: Tensor, next_norm: str, cos: Tensor, sin: Tensor,
               ring_pool: RingPool, ring_slots: Tensor, anchor_positions: Tensor) -> tuple[Tensor, Tensor]:
        """One draft layer on the blocks' residual stream ``x [B, S, C]``, given ``u`` = its input norm of x.

        Returns the new x and RMSNorm ``next_norm`` of it (the next layer's input norm, or the final norm):
        each sublayer's conv finish, residual add and the norm after it are one kernel.
        """
        w, p = self.w, f"layers.{layer}."
        u, delta = self._conv_prepare(u, f"{p}attention_conv")
        o = self._attention(layer, u, cos, sin, ring_pool, ring_slots, anchor_positions)
        x, u = self._conv_finish_norm(o, f"{p}attention_conv", delta, x, f"{p}post_attention_layernorm.weight")
        u, delta = self._conv_prepare(u, f"{p}mlp_conv")
        rows = u.reshape(-1, u.shape[-1])  # [B*S, C]
        act = skinny_linear(rows, self.gate_up[layer], swiglu=True)  # [B*S, I]
        m = skinny_linear(act, w[f"{p}mlp.down_proj.weight"])
        return self._conv_finish_norm(m.view(x.shape), f"{p}mlp_conv", delta, x, next_norm)

    def forward_blocks(self, anchor_tokens: Tensor, anchor_positions: Tensor, ring_pool: RingPool,
                       ring_slots: Tensor, layer_outputs: list[Tensor] | None = None) -> DraftBlocks:
        """Draft B blocks at once, block b from anchor ``anchor_tokens[b]`` at ``anchor_positions[b]``.

        anchor_tokens, anchor_positions, ring_slots: ``[B]`` long. Block b reads the ring of slot
        ``ring_slots[b]`` at positions s_b-W+1 .. s_b-1 (those >= 0), which must hold the committed
        context rows (``RingPool.check_readable`` audits that, with a host sync). The full S rows
        always run, whatever k. ``layer_outputs``, if given, receives each layer's ``[B, S, C]``.
        """
        cfg = self.cfg
        if not (anchor_tokens.dim() == 1 and anchor_tokens.shape == anchor_positions.shape == ring_slots.shape):
            raise ValueError(f"anchor_tokens {list(anchor_tokens.shape)}, anchor_positions "
                             f"{list(anchor_positions.shape)}, ring_slots {list(ring_slots.shape)}: expected [B] each")
        if ring_pool.window != cfg.sliding_window:
            raise ValueError(f"ring window {ring_pool.window} != the draft's sliding_window {cfg.sliding_window}")
        positions = anchor_positions[:, None] + self.block_offsets  # [B, S]
        tokens = torch.where(self.anchor_rows, anchor_tokens[:, None], cfg.mask_token_id)  # [B, S]
        x = self.embed[tokens]  # [B, S, C] (input_embedding_scale = 1)
        cos, sin = rope_cos_sin(positions.reshape(-1), cfg.head_dim, cfg.rope_theta)  # once: every layer, q and k
        cuts = layer_cuts(cfg.num_hidden_layers, groups=1)  # a captured step's first graphs short
        u = self._block_norm(x, "layers.0.input_layernorm.weight")  # later norms come with the finish before them
        for layer in range(cfg.num_hidden_layers):
            if layer in cuts:
                graph_cut()
            last = layer + 1 == cfg.num_hidden_layers
            next_norm = "norm.weight" if last else f"layers.{layer + 1}.input_layernorm.weight"
            x, u = self._layer(layer, x, u, next_norm, cos, sin, ring_pool, ring_slots, anchor_positions)
            if layer_outputs is not None:
                layer_outputs.append(x)
        hidden = u  # [B, S, C]: RMSNorm_norm of the last layer's x
        rows = hidden[:, 1:].reshape(-1, cfg.hidden_size)  # one 2-D GEMM (the 3-D slice ran as a slow bmm)
        # in the draft dtype: no fp32 copy of the B*(S-1) x V rows (the selector converts its candidates only)
        logits = linear(rows, self.lm_head).view(hidden.shape[0], cfg.block_size - 1, cfg.vocab_size)
        return DraftBlocks(hidden=hidden, logits=logits)
