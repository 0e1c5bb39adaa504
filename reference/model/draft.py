"""The DFlash 2 draft forward (facts sheet section 2), in fp32.

Anchor: the last committed token t0 at position s. Context rows come from the target::

    F_p = concat_{l in target_layer_ids} taps[l]_p               [m*C]   (taps[l] = HF hidden_states[l+1])
    c_p = RMSNorm_hidden_norm(W_fc F_p)                          [C]     shared by every draft layer
    k_p = RoPE_p(RMSNorm_k_norm(W_K c_p)),  v_p = W_V c_p         per layer and KV head; no input
                                                                 norm, no conv on context rows

The block: rows i = 0..S-1 at positions s+i, tokens [t0, mask, ..., mask], embedded with the
target's table (input_embedding_scale is refused unless 1). Each layer (pre-norm residual, a conv
around each sublayer, see ``conv.py``)::

    u = RMSNorm_in(x);    u', delta = prepare(u)
    q_i = RoPE_{s+i}(RMSNorm_q_norm(W_Q u'_i)),  k_i = RoPE_{s+i}(RMSNorm_k_norm(W_K u'_i)),  v_i = W_V u'_i
    a_i = softmax_j(q_i . k_j / sqrt(D)) over {block rows j} + {context p : s+i - p < W, p < s}
    x += finish(W_O a, delta)
    u = RMSNorm_post(x);  u', delta = prepare(u);  x += finish(SwiGLU(u'), delta)

then h = RMSNorm_norm(x) and z_i = W_lm^target h_i for rows i = 1..S-1 (row 0 is dropped).
Attention is non-causal inside the block, GQA (query head h reads KV head h // (H/Hkv)), fp32
softmax. The forward always runs all S rows, whatever k.

Checked against public sources: every RMSNorm here is Qwen3's plain ``w * x / rms(x)`` with
weights initialised to ones (z-lab/dflash ``dflash/model.py`` uses ``Qwen3RMSNorm``; its
``model_mlx.py`` uses ``nn.RMSNorm``; vLLM ``qwen3_dflash.py`` uses ``RMSNorm``), unlike the
target's zero-centred ``1 + w``. q_norm/k_norm are per head over D, before RoPE, and context keys
get k_norm too (model.py ``Qwen3DFlashAttention``; vLLM ``precompute_and_store_context_kv``).
RoPE is NeoX half rotation over the whole head (``rotate_half`` in model.py,
``traditional=False, dims=head_dim`` in model_mlx.py, ``is_neox_style`` default true in vLLM).
The window mask ``key < ctx_len and query - key < sliding_window`` over context plus the whole
block is model_mlx.py's ``DFlashAttention`` for a non-causal sliding layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .conv import conv_finish, conv_prepare
from ..formats.draft_config import DraftConfig
from .mlp import swiglu
from .rope import apply_rope


@dataclass(frozen=True)
class DraftBlockOutput:
    """One draft forward over the S block rows."""

    hidden: Tensor  # [S, C] after the final norm (row 0 included)
    logits: Tensor  # [S-1, V] unary logits z_i of rows 1..S-1 (slot i is logits[i-1])


def qwen3_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3 RMSNorm over the last axis: ``w * x / sqrt(mean(x^2) + eps)``, in fp32.

    x: ``[..., C]``; weight: ``[C]`` applied as stored (not zero-centred).
    """
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def window_attention(q: Tensor, positions: Tensor, block_k: Tensor, block_v: Tensor,
                     ctx_k: Tensor, ctx_v: Tensor, ctx_positions: Tensor, window: int) -> Tensor:
    """Non-causal block attention plus a symmetric window over context rows.

    q: ``[S, H, D]`` at ``positions [S]``; block_k, block_v: ``[S, Hkv, D]`` (the block's own rows,
    at the same positions); ctx_k, ctx_v: ``[N, Hkv, D]`` at ``ctx_positions [N]``, all before
    the block. Row i reads key j iff ``|positions[i] - pos_j| < window``; rows outside its window
    are never read (gathered out, not zero-weighted). Returns ``[S, H, D]``.
    """
    heads, d = q.shape[1], q.shape[2]
    group = heads // block_k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(q.shape[0]):
        ctx_seen = (positions[i] - ctx_positions).abs() < window  # [N]
        blk_seen = (positions[i] - positions).abs() < window  # [S]
        keys = torch.cat([ctx_k[ctx_seen], block_k[blk_seen]]).repeat_interleave(group, dim=1)  # [n, H, D]
        values = torch.cat([ctx_v[ctx_seen], block_v[blk_seen]]).repeat_interleave(group, dim=1)  # [n, H, D]
        scores = torch.einsum("hd,nhd->hn", q[i].float(), keys.float()) * d ** -0.5  # [H, n]
        weights = torch.softmax(scores.float(), dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", weights, values.float())
    return out


class ReferenceDraft:
    """A DFlash 2 draft bound to its target's embedding table and LM head."""

    def __init__(self, cfg: DraftConfig, draft_weights: Mapping[str, Tensor], target_weights: Mapping[str, Tensor]):
        self.cfg = cfg
        self.w = {name: t.float() for name, t in draft_weights.items()}
        self.embed = target_weights["embed_tokens.weight"].float()  # [V, C]
        self.lm_head = target_weights["lm_head.weight"].float()  # [V, C]
        expected = (cfg.vocab_size, cfg.hidden_size)
        for name, t in (("embed_tokens.weight", self.embed), ("lm_head.weight", self.lm_head)):
            if tuple(t.shape) != expected:
                raise ValueError(f"target {name} has shape {list(t.shape)}, expected {list(expected)} for this draft")

    # -- context side --------------------------------------------------------------------------

    def context_rows(self, taps: Sequence[Tensor]) -> Tensor:
        """c_p = RMSNorm_hidden_norm(W_fc concat_l taps[l]_p) for every row p. Returns ``[T, C]``.

        taps: one ``[T, C]`` residual output per target layer, indexed by layer id
        (``len(taps)`` = the target's layer count).
        """
        cfg = self.cfg
        if len(taps) != cfg.num_target_layers:
            raise ValueError(f"got {len(taps)} target layer outputs, expected {cfg.num_target_layers}")
        features = torch.cat([taps[layer].float() for layer in cfg.target_layer_ids], dim=-1)  # [T, m*C]
        return qwen3_rms_norm(features @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], cfg.rms_norm_eps)

    def context_kv(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Post-RoPE keys and values of context rows, as the ring stores them.

        rows: ``[T, C]`` (from :meth:`context_rows`) at absolute ``positions [T]``.
        Returns k, v, each ``[L_draft, T, Hkv, D]``.
        """
        cfg = self.cfg
        t, hkv, d = rows.shape[0], cfg.num_key_value_heads, cfg.head_dim
        keys, values = [], []
        for layer in range(cfg.num_hidden_layers):
            p = f"layers.{layer}.self_attn."
            k = (rows.float() @ self.w[f"{p}k_proj.weight"].T).reshape(t, hkv, d)  # [T, Hkv, D]
            k = qwen3_rms_norm(k, self.w[f"{p}k_norm.weight"], cfg.rms_norm_eps)
            keys.append(apply_rope(k, positions, d, cfg.rope_theta))
            values.append((rows.float() @ self.w[f"{p}v_proj.weight"].T).reshape(t, hkv, d))
        return torch.stack(keys), torch.stack(values)

    # -- the block -------------------------------------------------------------------------------

    def block_tokens(self, anchor_token: int) -> Tensor:
        """``[t0, mask, ..., mask]``, ``[S]`` long."""
        tokens = torch.full((self.cfg.block_size,), self.cfg.mask_token_id, dtype=torch.long)
        tokens[0] = anchor_token
        return tokens

    def _attention(self, layer: int, u: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                   ctx_positions: Tensor) -> Tensor:
        """The attention sublayer's ``W_O a`` for conv-prepared input ``u [S, C]``. Returns ``[S, C]``."""
        cfg = self.cfg
        p = f"layers.{layer}.self_attn."
        s, h, hkv, d = u.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = qwen3_rms_norm((u @ self.w[f"{p}q_proj.weight"].T).reshape(s, h, d), self.w[f"{p}q_norm.weight"],
                           cfg.rms_norm_eps)
        k = qwen3_rms_norm((u @ self.w[f"{p}k_proj.weight"].T).reshape(s, hkv, d), self.w[f"{p}k_norm.weight"],
                           cfg.rms_norm_eps)
        v = (u @ self.w[f"{p}v_proj.weight"].T).reshape(s, hkv, d)  # [S, Hkv, D]
        q, k = apply_rope(q, positions, d, cfg.rope_theta), apply_rope(k, positions, d, cfg.rope_theta)
        a = window_attention(q, positions, k, v, ctx_k, ctx_v, ctx_positions, cfg.sliding_window)  # [S, H, D]
        return a.reshape(s, h * d) @ self.w[f"{p}o_proj.weight"].T

    def _layer(self, layer: int, x: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor,
               ctx_positions: Tensor) -> Tensor:
        """One draft layer on the block's residual stream ``x [S, C]``. Returns ``[S, C]``."""
        cfg, w, p, g = self.cfg, self.w, f"layers.{layer}.", self.cfg.conv_group_size
        u = qwen3_rms_norm(x, w[f"{p}input_layernorm.weight"], cfg.rms_norm_eps)
        base, proj = w[f"{p}attention_conv.base_kernel"], w[f"{p}attention_conv.kernel_projection.weight"]
        u, delta = conv_prepare(u, base, proj, g)
        o = self._attention(layer, u, positions, ctx_k, ctx_v, ctx_positions)
        x = x + conv_finish(o, base, delta, g)

        u = qwen3_rms_norm(x, w[f"{p}post_attention_layernorm.weight"], cfg.rms_norm_eps)
        base, proj = w[f"{p}mlp_conv.base_kernel"], w[f"{p}mlp_conv.kernel_projection.weight"]
        u, delta = conv_prepare(u, base, proj, g)
        m = swiglu(u, w[f"{p}mlp.gate_proj.weight"], w[f"{p}mlp.up_proj.weight"], w[f"{p}mlp.down_proj.weight"])
        return x + conv_finish(m, base, delta, g)

    def forward_block(self, anchor_token: int, anchor_position: int, ctx_positions: Tensor,
                      ctx_k: Tensor, ctx_v: Tensor) -> DraftBlockOutput:
        """Draft one block from anchor ``t0`` at position ``s`` over the given context K/V.

        ctx_positions: ``[N]`` absolute, each < s (normally s-W+1 .. s-1, those that exist; older
        rows may be passed and are masked per row); ctx_k, ctx_v: ``[L_draft, N, Hkv, D]``
        (post-RoPE keys, as :meth:`context_kv` returns them).
        """
        cfg = self.cfg
        if not 0 <= anchor_token < cfg.vocab_size:
            raise ValueError(f"anchor_token={anchor_token}: expected a token id in 0 .. {cfg.vocab_size - 1}")
        ctx_positions = torch.as_tensor(ctx_positions, dtype=torch.long)
        if ctx_positions.numel() and int(ctx_positions.max()) >= anchor_position:
            raise ValueError(f"context position {int(ctx_positions.max())} is not before the anchor at "
                             f"{anchor_position}: the draft reads only committed rows < s")
        expected = (cfg.num_hidden_layers, ctx_positions.shape[0], cfg.num_key_value_heads, cfg.head_dim)
        if tuple(ctx_k.shape) != expected or tuple(ctx_v.shape) != expected:
            raise ValueError(f"ctx_k/ctx_v shapes {list(ctx_k.shape)}/{list(ctx_v.shape)}, expected {list(expected)}")

        positions = anchor_position + torch.arange(cfg.block_size)  # [S]
        x = self.embed[self.block_tokens(anchor_token)]  # [S, C] (input_embedding_scale = 1)
        for layer in range(cfg.num_hidden_layers):
            x = self._layer(layer, x, positions, ctx_k[layer], ctx_v[layer], ctx_positions)
        hidden = qwen3_rms_norm(x, self.w["norm.weight"], cfg.rms_norm_eps)  # [S, C]
        return DraftBlockOutput(hidden=hidden, logits=hidden[1:] @ self.lm_head.T)  # logits [S-1, V]
