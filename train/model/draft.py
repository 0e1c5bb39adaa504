"""The DFlash 2 draft forward and selector scores, batched and differentiable, for training.

The twin of ``reference/model/draft.py`` (``ReferenceDraft``: context_rows -> context_kv ->
forward_block) and of the selector's ``edge_scores``, run for many anchors at once against a
frozen target. Inputs per batch: N sequences of T positions, their tapped target features
``F [N, T, m*C]`` (taps of ``target_layer_ids``, in that order), A anchors per sequence
``anchors [N, A]`` (1 <= s <= T-B) and each block's input embeddings ``[N, A, B, C]`` (the
target's table at ``[x_s, mask, ..., mask]``). Per sequence and draft layer the context K/V is
computed once::

    c_p = RMSNorm_hidden_norm(W_fc F_p)                                   [N, T, C]
    k_p = RoPE_p(RMSNorm_k_norm(W_K c_p)),  v_p = W_V c_p                 [N, T, Hkv, D]

and every block of the sequence attends in one SDPA call over keys ``[context T | blocks A*B]``:
row i of anchor a (position s_a + i) reads context p iff ``p < s_a and s_a + i - p < W``, and the
B rows of its own block (non-causal; W >= B by config, so the window never clips a block). The
layers are the reference's (pre-norm, a grouped dynamic conv around each sublayer, see
``draft_conv.py``), and ``h = RMSNorm_norm(x)``; row i >= 1 of a block predicts position s+i.

Every RMSNorm is Qwen3's plain ``w * x / rms(x)``, computed in fp32 and returned in the input's
dtype, so the module runs in fp32 or under ``torch.autocast`` (bf16). Parameter names are the
draft checkpoint's (``reference/formats/draft_checkpoint.py``); the embedding table and LM head
stay the target's and are not parameters here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import skip_init

from dflash2.reference.formats.draft_checkpoint import expected_draft_shapes
from dflash2.reference.formats.draft_config import DraftConfig
from dflash2.reference.formats.errors import CheckpointError

from .draft_conv import GroupedDynamicConv
from .rms_norm import Qwen3RMSNorm


def linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free projection left uninitialised (``init_weights`` or a checkpoint fills it; the
    global RNG is never drawn from)."""
    return skip_init(nn.Linear, in_features, out_features, bias=False)


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """NeoX half rotation over the whole head: ``x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin`` at
    angle ``p * theta^(-2j/D)``. x: ``[..., H, D]``; positions: x's leading axes ``[...]`` (or a
    suffix of them). Computed in fp32, returned in x's dtype."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))  # [D/2]
    angles = positions.to(torch.float32)[..., None, None] * inv_freq  # [..., 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def block_attention_mask(anchors: Tensor, num_ctx: int, block_size: int, window: int) -> Tensor:
    """Which keys each block row reads, ``[N, 1, A*B, T + A*B]`` bool (True = read).

    Query row ``a*B + i`` sits at position ``s_a + i``. Keys ``0 .. T-1`` are the context
    positions: read iff ``p < s_a`` and ``s_a + i - p < window``. Keys ``T + a'*B + j`` are block
    rows: read iff ``a' == a`` (the caller guarantees ``window >= block_size``, as the draft config
    does, so the window never cuts inside a block).
    """
    n, a = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    anchor_of_row = anchors[:, :, None].expand(n, a, block_size).reshape(n, a * block_size)  # [N, A*B]
    query_pos = (anchors[:, :, None] + offsets).reshape(n, a * block_size)  # [N, A*B]
    ctx_pos = torch.arange(num_ctx, device=anchors.device)  # [T]
    ctx = (ctx_pos < anchor_of_row[:, :, None]) & (query_pos[:, :, None] - ctx_pos < window)  # [N, A*B, T]
    block_of_row = torch.arange(a, device=anchors.device).repeat_interleave(block_size)  # [A*B]
    own = (block_of_row[:, None] == block_of_row[None, :]).expand(n, -1, -1)  # [N, A*B, A*B]
    return torch.cat([ctx, own], dim=-1)[:, None]


class DraftAttention(nn.Module):
    """``self_attn``: q/k/v/o projections and per-head q/k norms; GQA over context + block keys."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        c, h, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim, self.theta = h, hkv, d, cfg.rope_theta
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = linear(c, h * d), linear(c, hkv * d), \
            linear(c, hkv * d), linear(h * d, c)
        self.q_norm, self.k_norm = Qwen3RMSNorm(d, cfg.rms_norm_eps), Qwen3RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Post-RoPE keys and values of rows ``x [..., C]`` at ``positions [...]``: each ``[..., Hkv, D]``."""
        k = apply_rope(self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))), positions,
                       self.theta)
        return k, self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))

    def forward(self, u: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """u: conv-prepared block rows ``[N, A, B, C]`` at ``positions [N, A, B]``; ctx_k, ctx_v:
        ``[N, T, Hkv, D]``; mask from :func:`block_attention_mask`. Returns ``W_O a``, ``[N, A, B, C]``."""
        n, a, b, _ = u.shape
        q = apply_rope(self.q_norm(self.q_proj(u).unflatten(-1, (self.heads, self.head_dim))), positions, self.theta)
        k, v = self.keys_values(u, positions)  # [N, A, B, Hkv, D]
        keys = torch.cat([ctx_k, k.flatten(1, 2)], dim=1).transpose(1, 2)  # [N, Hkv, T + A*B, D]
        values = torch.cat([ctx_v, v.flatten(1, 2)], dim=1).transpose(1, 2)
        # query head h reads KV head h // group; expanded here (not enable_gqa) so a masked
        # memory-efficient SDPA kernel stays eligible
        group = self.heads // self.kv_heads
        keys = keys[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)  # [N, H, T + A*B, D]
        values = values[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)
        out = F.scaled_dot_product_attention(q.flatten(1, 2).transpose(1, 2), keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(n, a, b, self.heads * self.head_dim))  # [N, A, B, C]


class DraftMLP(nn.Module):
    """``mlp``: SwiGLU, ``W_down (silu(W_gate x) * W_up x)``."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        c, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = linear(c, i), linear(c, i), linear(i, c)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """``layers.l``: pre-norm residual, each sublayer wrapped by its conv (prepare, sublayer, finish)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        c, taps, g = cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size
        self.input_layernorm = Qwen3RMSNorm(c, cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c, cfg.rms_norm_eps)
        self.self_attn, self.mlp = DraftAttention(cfg), DraftMLP(cfg)
        self.attention_conv, self.mlp_conv = GroupedDynamicConv(c, taps, g), GroupedDynamicConv(c, taps, g)

    def forward(self, x: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """x: the blocks' residual stream ``[N, A, B, C]``. Returns ``[N, A, B, C]``."""
        u, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, positions, ctx_k, ctx_v, mask), delta)
        u, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), delta)


class CandidateSelector(nn.Module):
    """``candidate_selector``: ``hidden_projection`` P ``[r, C]``, codebooks A, Bc ``[V, r]``."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.hidden_projection = linear(cfg.hidden_size, cfg.selector_rank)
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))


class TrainableDraft(nn.Module):
    """A DFlash 2 draft's own parameters (no embedding, no LM head), batched over anchors."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.hidden_size
        self.fc = linear(cfg.num_taps * c, c)
        self.hidden_norm, self.norm = Qwen3RMSNorm(c, cfg.rms_norm_eps), Qwen3RMSNorm(c, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.candidate_selector = CandidateSelector(cfg)
        names = {name: tuple(p.shape) for name, p in self.named_parameters()}
        if names != expected_draft_shapes(cfg):  # the module tree is the checkpoint's layout
            raise AssertionError(f"TrainableDraft parameters {sorted(names)} differ from the draft checkpoint's")
        self.init_weights(0)

    # -- the forward -----------------------------------------------------------------------------

    def forward(self, features: Tensor, anchors: Tensor, block_embeds: Tensor) -> Tensor:
        """features ``[N, T, m*C]``, anchors ``[N, A]`` long, block_embeds ``[N, A, B, C]``.
        Returns the final hidden ``h [N, A, B, C]`` (after ``norm``, row 0 included)."""
        cfg = self.cfg
        self._check_inputs(features, anchors, block_embeds)
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(features.to(dtype)))  # [N, T, C]
        ctx_positions = torch.arange(features.shape[1], device=features.device)  # [T]
        positions = anchors[:, :, None] + torch.arange(cfg.block_size, device=anchors.device)  # [N, A, B]
        mask = block_attention_mask(anchors, features.shape[1], cfg.block_size, cfg.sliding_window)
        x = block_embeds.to(dtype)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.keys_values(ctx, ctx_positions)  # [N, T, Hkv, D], once per layer
            x = layer(x, positions, ctx_k, ctx_v, mask)
        return self.norm(x)

    def _check_inputs(self, features: Tensor, anchors: Tensor, block_embeds: Tensor) -> None:
        cfg = self.cfg
        if features.dim() != 3 or features.shape[-1] != cfg.num_taps * cfg.hidden_size:
            raise ValueError(f"features shape {list(features.shape)}: expected [N, T, {cfg.num_taps * cfg.hidden_size}] "
                             f"(m={cfg.num_taps} taps of hidden_size={cfg.hidden_size})")
        n, t = features.shape[:2]
        if anchors.dim() != 2 or anchors.shape[0] != n or anchors.dtype != torch.long:
            raise ValueError(f"anchors shape {list(anchors.shape)} dtype {anchors.dtype}: expected [{n}, A] long")
        expected = (n, anchors.shape[1], cfg.block_size, cfg.hidden_size)
        if tuple(block_embeds.shape) != expected:
            raise ValueError(f"block_embeds shape {list(block_embeds.shape)}: expected {list(expected)}")
        if anchors.numel():
            low, high = int(anchors.min()), int(anchors.max())
            if low < 1 or high > t - cfg.block_size:
                raise ValueError(f"anchors span {low} .. {high}: expected each s in 1 .. T - B = "
                                 f"{t - cfg.block_size} (T={t}, block_size={cfg.block_size})")

    def selector_scores(self, hidden: Tensor, cand_ids: Tensor, cand_logits: Tensor, prev_ids: Tensor) -> Tensor:
        """The selector's edge scores ``sigma[..., j] = U[..., j] + < A[prev] * (P h), Bc[cand_ids[..., j]] >``.

        hidden ``[..., C]``, cand_ids and cand_logits (U) ``[..., K]``, prev_ids ``[...]`` long.
        Returns ``[..., K]``.
        """
        lead = hidden.shape[:-1]
        if cand_ids.shape[:-1] != lead or cand_logits.shape != cand_ids.shape or prev_ids.shape != lead:
            raise ValueError(f"selector inputs hidden {list(hidden.shape)}, cand_ids {list(cand_ids.shape)}, "
                             f"cand_logits {list(cand_logits.shape)}, prev_ids {list(prev_ids.shape)}: expected "
                             f"[..., C], [..., K], [..., K] and [...] with the same leading axes")
        sel = self.candidate_selector
        pred = sel.predecessor_codebook[prev_ids] * sel.hidden_projection(hidden)  # [..., r]
        return cand_logits + (sel.successor_codebook[cand_ids] @ pred.unsqueeze(-1)).squeeze(-1)  # [..., K]

    # -- weights ---------------------------------------------------------------------------------

    def canonical_state_dict(self) -> dict[str, Tensor]:
        """Every parameter under its draft checkpoint name, in the checkpoint's order (detached, shared)."""
        params = dict(self.named_parameters())
        return {name: params[name].detach() for name in expected_draft_shapes(self.cfg)}

    @classmethod
    def from_canonical(cls, cfg: DraftConfig, weights: Mapping[str, Tensor]) -> TrainableDraft:
        """A draft (fp32, on CPU) holding ``weights``: exactly the checkpoint's names and shapes."""
        expected = expected_draft_shapes(cfg)
        missing = [name for name in expected if name not in weights]
        extras = sorted(set(weights) - set(expected))
        if missing or extras:
            raise CheckpointError(f"draft weights: missing {missing[:3]}, unexpected {extras[:3]}; expected exactly "
                                  f"the {len(expected)} tensors of expected_draft_shapes")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise CheckpointError(f"tensor {name!r} has shape {list(weights[name].shape)}, expected {list(shape)}")
        model = cls(cfg)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in expected:
                params[name].copy_(weights[name])
        return model

    def init_weights(self, seed: int) -> None:
        """The training init, a pure function of ``seed`` (drawn on CPU, so every device gets the same).

        Matrices and codebooks N(0, 0.02^2), the residual outputs ``o_proj`` and ``down_proj``
        N(0, (0.02 / sqrt(2L))^2); RMSNorm weights 1; each conv the identity (``base[:, 0] = 1``,
        later taps 0, ``kernel_projection`` 0).
        """
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_hidden_layers)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, shape in expected_draft_shapes(self.cfg).items():  # a fixed draw order
                if name.endswith("norm.weight"):
                    value = torch.ones(shape)
                elif name.endswith("base_kernel"):
                    value = torch.zeros(shape)
                    value[:, 0] = 1.0
                elif name.endswith("kernel_projection.weight"):
                    value = torch.zeros(shape)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    value = torch.randn(shape, generator=gen) * residual_std
                else:
                    value = torch.randn(shape, generator=gen) * 0.02
                params[name].copy_(value)
