"""The sharding plan: how each canonical target tensor splits across ``tp`` ranks, and the rank's config view.

Megatron/vLLM/SGLang tensor parallelism. A linear ``y = W x`` with ``W [R, K]`` is either

- **column-parallel** (split the output rows R): rank r holds ``W[rows_r]`` and computes its slice
  ``y[rows_r]`` from the full, replicated x; nothing to communicate. The head-structured projections
  split by heads, so every rank runs whole heads: attention q|gate (H heads), k and v (Hkv heads);
  the GDN input projection's q, k (Hk key heads), v and z (Hv value heads), b and a (Hv); the MLP's
  gate and up rows (intermediate I); the LM head's vocabulary rows V.
- **row-parallel** (split the input columns K): rank r holds ``W[:, cols_r]`` and computes the partial
  ``W[:, cols_r] x[cols_r]`` from its own column-parallel output; ``y = sum_r`` of them, one
  all-reduce. Attention o_proj (H D columns), GDN out_proj (Hv Dv), MLP down (I), expert down (I).

So each mixer and each MLP is one column-parallel projection, local per-head work, one row-parallel
projection and one all-reduce (fast/model/layer.py): two all-reduces per layer, as in vLLM.

A fused tensor is a concatenation of **segments** along its split dim, and each segment splits on its
own: rank r takes the r-th of tp equal chunks of every segment, concatenated in segment order. The GDN
``in_proj_qkv [2 Hk Dk + Hv Dv, C]`` has segments ``[Hk Dk (q), Hk Dk (k), Hv Dv (v)]``, so rank r gets
``[q heads_r | k heads_r | v heads_r]``, exactly the layout the local model expects for Hk/tp and Hv/tp
heads; ``conv1d [Cd, 1, K]`` is depthwise over those channels and splits the same way. A routed expert's
``gate_up [E, 2I, C]`` has segments ``[I (gate), I (up)]`` on dim 1.

Per-head parameters follow their heads (``A_log``, ``dt_bias`` [Hv]); parameters shared by all heads are
replicated (q_norm/k_norm [D], the GDN output norm [Dv], every hidden-size norm, the router, the shared
expert's gate vector). Grouped-query attention stays right because both head counts split by tp:
query head h reads KV head ``h // (H/Hkv)``, and the local ratio ``(H/tp)/(Hkv/tp)`` is the same; likewise
GDN value head h reads key head ``h // (Hv/Hk)`` (the reference's ``repeat_interleave``).

MoE: every rank holds **every expert, with its intermediate dim I split** (TP-MoE, vLLM's and SGLang's
default without expert parallelism), not a subset of whole experts (EP). Each rank routes the same
replicated rows identically, runs all its chosen experts on its I/tp slice, and adds the shared expert's
partial output (sigmoid(w_sg . x) scales a partial sum linearly): the sublayer still ends in one
all-reduce, with no all-to-all, and the work per rank is the same whatever the routing picks (EP's load
depends on it). The same fused kernels run, narrower. EP pays off at many ranks over many experts and is
a later step.

Where a count does not divide by tp the plan refuses (:func:`rank_config`), naming the field and value;
vLLM replicates KV heads when tp > Hkv, which this step does not do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor
import torch

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.formats.errors import ConfigError


@dataclass(frozen=True)
class ShardSpec:
    """How one tensor splits: ``dim`` and the segment sizes along it (summing to its length), each cut into
    tp equal chunks; ``dim`` None: replicated (every rank holds the whole tensor)."""

    dim: int | None
    segments: tuple[int, ...] = ()

    @property
    def replicated(self) -> bool:
        return self.dim is None


REPLICATED = ShardSpec(None)


def _rows(*segments: int) -> ShardSpec:
    return ShardSpec(0, segments)


# name suffix -> spec, from the full config. Column-parallel: dim 0 (or an expert's row dim 1); row-parallel: the
# input-column dim. Suffixes are matched after the layer prefix (``layers.{i}.``, ``mtp.layers.0.``).
_RULES: dict[str, Callable[[TargetConfig], ShardSpec]] = {
    # vocabulary-parallel embedding and LM head: V rows
    "embed_tokens.weight": lambda c: _rows(c.vocab_size),
    "lm_head.weight": lambda c: _rows(c.vocab_size),
    # gated full attention. q_proj rows are per head [query D | gate D]: whole heads are contiguous 2D blocks
    "self_attn.q_proj.weight": lambda c: _rows(2 * c.num_attention_heads * c.head_dim),
    "self_attn.k_proj.weight": lambda c: _rows(c.num_key_value_heads * c.head_dim),
    "self_attn.v_proj.weight": lambda c: _rows(c.num_key_value_heads * c.head_dim),
    "self_attn.o_proj.weight": lambda c: ShardSpec(1, (c.num_attention_heads * c.head_dim,)),
    "self_attn.q_norm.weight": lambda c: REPLICATED,
    "self_attn.k_norm.weight": lambda c: REPLICATED,
    # Gated DeltaNet: conv channels [q | k | v], then z, b, a by value heads
    "linear_attn.in_proj_qkv.weight": lambda c: _rows(c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim),
    "linear_attn.conv1d.weight": lambda c: _rows(c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim),
    "linear_attn.in_proj_z.weight": lambda c: _rows(c.gdn_value_dim),
    "linear_attn.in_proj_b.weight": lambda c: _rows(c.linear_num_value_heads),
    "linear_attn.in_proj_a.weight": lambda c: _rows(c.linear_num_value_heads),
    "linear_attn.dt_bias": lambda c: _rows(c.linear_num_value_heads),
    "linear_attn.A_log": lambda c: _rows(c.linear_num_value_heads),
    "linear_attn.norm.weight": lambda c: REPLICATED,  # [Dv], shared by the value heads
    "linear_attn.out_proj.weight": lambda c: ShardSpec(1, (c.gdn_value_dim,)),
    # dense SwiGLU MLP
    "mlp.gate_proj.weight": lambda c: _rows(c.intermediate_size),
    "mlp.up_proj.weight": lambda c: _rows(c.intermediate_size),
    "mlp.down_proj.weight": lambda c: ShardSpec(1, (c.intermediate_size,)),
    # MoE: every expert on every rank, its intermediate dim split (module docstring)
    "mlp.gate.weight": lambda c: REPLICATED,  # the router: every rank routes the same rows the same way
    "mlp.experts.gate_up_proj": lambda c: ShardSpec(1, (c.moe_intermediate_size, c.moe_intermediate_size)),
    "mlp.experts.down_proj": lambda c: ShardSpec(2, (c.moe_intermediate_size,)),
    "mlp.shared_expert.gate_proj.weight": lambda c: _rows(c.shared_expert_intermediate_size),
    "mlp.shared_expert.up_proj.weight": lambda c: _rows(c.shared_expert_intermediate_size),
    "mlp.shared_expert.down_proj.weight": lambda c: ShardSpec(1, (c.shared_expert_intermediate_size,)),
    "mlp.shared_expert_gate.weight": lambda c: REPLICATED,
}
# every hidden-size norm (input/post layernorms, the final norm, the MTP head's norms) and the MTP fc
_REPLICATED_SUFFIXES = ("layernorm.weight", "norm.weight", "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                        "mtp.pre_fc_norm_hidden.weight")


def shard_spec(name: str, cfg: TargetConfig) -> ShardSpec:
    """The :class:`ShardSpec` of canonical tensor ``name`` of the full config ``cfg``."""
    for suffix, rule in _RULES.items():
        if name == suffix or name.endswith("." + suffix):
            return rule(cfg)
    if name.endswith(_REPLICATED_SUFFIXES):
        return REPLICATED
    raise KeyError(f"{name!r}: no tensor-parallel sharding rule for this canonical tensor")


def shard_tensor(tensor: Tensor, spec: ShardSpec, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s part of ``tensor``: along ``spec.dim``, the rank-th of ``size`` equal chunks of every
    segment, concatenated in segment order (a view when there is one segment; the tensor itself if
    replicated or size 1)."""
    if spec.replicated or size == 1:
        return tensor
    if sum(spec.segments) != tensor.shape[spec.dim]:
        raise ValueError(f"segments {spec.segments} do not cover dim {spec.dim} of shape {list(tensor.shape)}")
    parts, offset = [], 0
    for seg in spec.segments:
        if seg % size:
            raise ConfigError(f"a segment of {seg} along dim {spec.dim} does not split into tp={size} equal parts")
        chunk = seg // size
        parts.append(tensor.narrow(spec.dim, offset + rank * chunk, chunk))
        offset += seg
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


def _divisible_fields(cfg: TargetConfig) -> tuple[str, ...]:
    fields = ("vocab_size", "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
              "linear_num_value_heads")
    if cfg.is_moe:
        return fields + ("moe_intermediate_size", "shared_expert_intermediate_size")
    return fields + ("intermediate_size",)


def rank_config(cfg: TargetConfig, tp: int) -> TargetConfig:
    """The config one rank's modules and cache pools see: every split count divided by ``tp``.

    Heads (H, Hkv, Hk, Hv), the intermediate sizes and the vocabulary are per rank; sizes per head
    (head_dim, Dk, Dv), the hidden size, the layer layout, the expert count and top-k stay, so the
    derived fields (rotary_dim, gdn_key_dim = Hk/tp * Dk, gdn_conv_dim, ...) are the rank's. tp=1: ``cfg``.
    Refuses (:class:`ConfigError` naming the field and its value) a count that does not divide by tp.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r}: expected an integer >= 1")
    if tp == 1:
        return cfg
    local = {}
    for field in _divisible_fields(cfg):
        value = getattr(cfg, field)
        if value % tp:
            raise ConfigError(f"{field}={value}: expected a multiple of the tensor-parallel size tp={tp} "
                              f"(every rank holds {field}/tp of them)")
        local[field] = value // tp
    return replace(cfg, **local)
