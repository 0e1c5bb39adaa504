"""The canonical tensor names and shapes of a target's text model.

This table is the contract between the checkpoint loader (which maps whatever is on disk onto
it), the checkpoint factory (which writes real HF layouts that map onto it) and both model
implementations (which read only these names). Names are relative to the text model, as in
transformers' ``Qwen3_5ForCausalLM`` with the ``model.`` prefix dropped:

- ``embed_tokens.weight [V, C]``, ``norm.weight [C]``, ``lm_head.weight [V, C]`` (the loader
  aliases it to the embedding when embeddings are tied);
- per layer ``layers.{i}.``: ``input_layernorm.weight``, ``post_attention_layernorm.weight``;
  GDN layers ``linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, out_proj}.weight``,
  ``linear_attn.{dt_bias, A_log}``, ``linear_attn.norm.weight [Dv]``; full-attention layers
  ``self_attn.{q,k,v,o}_proj.weight``, ``self_attn.{q,k}_norm.weight [D]``;
- dense MLP ``mlp.{gate,up,down}_proj.weight``; MoE ``mlp.gate.weight [E, C]``,
  ``mlp.experts.gate_up_proj [E, 2I, C]`` (gate rows first), ``mlp.experts.down_proj [E, C, I]``,
  ``mlp.shared_expert.{gate,up,down}_proj.weight``, ``mlp.shared_expert_gate.weight [1, C]``;
- MTP (when ``mtp_num_hidden_layers`` is 1): ``mtp.fc.weight [C, 2C]``,
  ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight``
  and one full-attention decoder layer ``mtp.layers.0.*`` with the model's MLP kind.

RMSNorm weights are zero-centred (applied as ``1 + w``) except the GDN output norm
``linear_attn.norm.weight``, which is applied as ``w``.
"""

from __future__ import annotations

from .config import TargetConfig

Shape = tuple[int, ...]


def _attention_shapes(cfg: TargetConfig, prefix: str) -> dict[str, Shape]:
    c, h, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {
        f"{prefix}self_attn.q_proj.weight": (2 * h * d, c),
        f"{prefix}self_attn.k_proj.weight": (hkv * d, c),
        f"{prefix}self_attn.v_proj.weight": (hkv * d, c),
        f"{prefix}self_attn.o_proj.weight": (c, h * d),
        f"{prefix}self_attn.q_norm.weight": (d,),
        f"{prefix}self_attn.k_norm.weight": (d,),
    }


def _gdn_shapes(cfg: TargetConfig, prefix: str) -> dict[str, Shape]:
    c, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        f"{prefix}linear_attn.in_proj_qkv.weight": (cfg.gdn_conv_dim, c),
        f"{prefix}linear_attn.in_proj_z.weight": (cfg.gdn_value_dim, c),
        f"{prefix}linear_attn.in_proj_b.weight": (hv, c),
        f"{prefix}linear_attn.in_proj_a.weight": (hv, c),
        f"{prefix}linear_attn.conv1d.weight": (cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{prefix}linear_attn.dt_bias": (hv,),
        f"{prefix}linear_attn.A_log": (hv,),
        f"{prefix}linear_attn.norm.weight": (cfg.linear_value_head_dim,),
        f"{prefix}linear_attn.out_proj.weight": (c, cfg.gdn_value_dim),
    }


def _mlp_shapes(cfg: TargetConfig, prefix: str) -> dict[str, Shape]:
    c = cfg.hidden_size
    if not cfg.is_moe:
        i = cfg.intermediate_size
        return {
            f"{prefix}mlp.gate_proj.weight": (i, c),
            f"{prefix}mlp.up_proj.weight": (i, c),
            f"{prefix}mlp.down_proj.weight": (c, i),
        }
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    return {
        f"{prefix}mlp.gate.weight": (e, c),
        f"{prefix}mlp.experts.gate_up_proj": (e, 2 * i, c),
        f"{prefix}mlp.experts.down_proj": (e, c, i),
        f"{prefix}mlp.shared_expert.gate_proj.weight": (s, c),
        f"{prefix}mlp.shared_expert.up_proj.weight": (s, c),
        f"{prefix}mlp.shared_expert.down_proj.weight": (c, s),
        f"{prefix}mlp.shared_expert_gate.weight": (1, c),
    }


def _layer_shapes(cfg: TargetConfig, prefix: str, layer_type: str) -> dict[str, Shape]:
    c = cfg.hidden_size
    shapes = {f"{prefix}input_layernorm.weight": (c,), f"{prefix}post_attention_layernorm.weight": (c,)}
    mixer = _attention_shapes if layer_type == "full_attention" else _gdn_shapes
    shapes.update(mixer(cfg, prefix))
    shapes.update(_mlp_shapes(cfg, prefix))
    return shapes


def expected_target_shapes(cfg: TargetConfig) -> dict[str, Shape]:
    """Every canonical tensor the text model (and its MTP head, if any) needs, with its shape."""
    v, c = cfg.vocab_size, cfg.hidden_size
    shapes: dict[str, Shape] = {"embed_tokens.weight": (v, c), "norm.weight": (c,), "lm_head.weight": (v, c)}
    for i, layer_type in enumerate(cfg.layer_types):
        shapes.update(_layer_shapes(cfg, f"layers.{i}.", layer_type))
    if cfg.mtp_num_hidden_layers:
        shapes.update({
            "mtp.fc.weight": (c, 2 * c),
            "mtp.pre_fc_norm_embedding.weight": (c,),
            "mtp.pre_fc_norm_hidden.weight": (c,),
            "mtp.norm.weight": (c,),
        })
        shapes.update(_layer_shapes(cfg, "mtp.layers.0.", "full_attention"))
    return shapes


def is_zero_centred_norm(name: str) -> bool:
    """Whether a canonical norm weight is applied as ``1 + w`` (all but the GDN output norm)."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")
