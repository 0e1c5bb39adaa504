"""Target model configuration: parsing and validation of HF ``config.json`` for Qwen3.5 hybrids.

Shared by the reference and the fast engine so both refuse and accept exactly the same
checkpoints. Accepted ``model_type`` values:

- ``qwen3_5_text`` / ``qwen3_5_moe_text``: the text model's config at the top level
  (tensors under ``model.``);
- ``qwen3_5`` / ``qwen3_5_moe``: the multimodal wrapper, text fields nested under
  ``text_config`` (tensors under ``model.language_model.``; the vision tower is ignored).

Every refusal is a :class:`ConfigError` naming the field, its value and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, expect, positive_int

DENSE_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
WRAPPER_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class TargetConfig:
    """The text model of a Qwen3.5-family hybrid, as this project understands it.

    Shapes it implies (C hidden, H/Hkv/D attention heads, Hk/Hv/Dk/Dv GDN heads):
    full attention ``q_proj [2*H*D, C]`` (query and output gate interleaved per head),
    ``k_proj, v_proj [Hkv*D, C]``; GDN ``in_proj_qkv [2*Hk*Dk + Hv*Dv, C]``,
    ``conv1d [2*Hk*Dk + Hv*Dv, 1, K]``.
    """

    model_type: str  # as written at the top of config.json
    is_moe: bool
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # dense MLP (0 for MoE)
    intermediate_size: int
    # MoE (0 for dense)
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    # multi-token prediction head (0 layers: none)
    mtp_num_hidden_layers: int
    eos_token_ids: tuple[int, ...]
    # where the text model's tensors live in the checkpoint
    weight_prefix: str

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that RoPE rotates (NeoX halves); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k and v concatenated."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim


def read_config_json(model_path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` from a checkpoint folder, refusing a missing folder or file."""
    path = Path(model_path)
    if not path.exists():
        raise ConfigError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ConfigError(f"model path {str(path)!r} is not a directory (expected a checkpoint folder)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model path {str(path)!r} holds no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    return config


def load_target_config(model_path: str | Path) -> TargetConfig:
    """Parse and validate the target's ``config.json``."""
    return parse_target_config(read_config_json(model_path))


def _rope_fields(text: dict[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` or the legacy flat fields.

    Text-only M-RoPE (``mrope_section``) gives every section the same position, which is
    exactly plain partial NeoX RoPE, so it is accepted and ignored.
    """
    params = dict(text.get("rope_parameters") or {})
    legacy_scaling = text.get("rope_scaling")
    if legacy_scaling:
        params = {**legacy_scaling, **params}
    rope_type = params.get("rope_type", params.get("type", "default"))
    expect(rope_type == "default", ConfigError, "rope_parameters.rope_type", rope_type,
           "'default' (RoPE scaling is not supported)")
    theta = params.get("rope_theta", text.get("rope_theta"))
    expect(isinstance(theta, (int, float)) and theta > 0, ConfigError, "rope_parameters.rope_theta", theta,
           "a positive number")
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    expect(isinstance(factor, (int, float)) and 0 < factor <= 1, ConfigError,
           "rope_parameters.partial_rotary_factor", factor, "a number in (0, 1]")
    return float(theta), float(factor)


def _layer_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        expect(isinstance(interval, int) and interval >= 1, ConfigError, "full_attention_interval", interval,
               "a positive integer")
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    expect(isinstance(layer_types, list) and len(layer_types) == num_layers, ConfigError, "layer_types",
           layer_types, f"a list of {num_layers} entries (num_hidden_layers)")
    for i, kind in enumerate(layer_types):
        expect(kind in LAYER_TYPES, ConfigError, f"layer_types[{i}]", kind, f"one of {LAYER_TYPES}")
    return tuple(layer_types)


def _eos_ids(top: dict[str, Any], text: dict[str, Any]) -> tuple[int, ...]:
    eos = text.get("eos_token_id", top.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def parse_target_config(top: dict[str, Any]) -> TargetConfig:
    """Validate a parsed ``config.json`` and return the text model's :class:`TargetConfig`."""
    model_type = top.get("model_type")
    expect(model_type in DENSE_MODEL_TYPES + MOE_MODEL_TYPES, ConfigError, "model_type", model_type,
           f"one of {DENSE_MODEL_TYPES + MOE_MODEL_TYPES}")
    if model_type in WRAPPER_MODEL_TYPES:
        text = top.get("text_config")
        expect(isinstance(text, dict), ConfigError, "text_config", text,
               f"an object with the text model's fields (model_type {model_type!r} nests them)")
        prefix = "model.language_model."
    else:
        text = top
        prefix = "model."
    expect("quantization_config" not in top and "quantization_config" not in text, ConfigError,
           "quantization_config", top.get("quantization_config", text.get("quantization_config")),
           "absent (quantized targets are not supported yet)")
    is_moe = model_type in MOE_MODEL_TYPES

    act = text.get("hidden_act", "silu")
    expect(act == "silu", ConfigError, "hidden_act", act, "'silu'")
    expect(not text.get("attention_bias", False), ConfigError, "attention_bias", text.get("attention_bias"),
           "false")
    expect(text.get("attn_output_gate", True) is True, ConfigError, "attn_output_gate",
           text.get("attn_output_gate"), "true (Qwen3.5 gates every full-attention output)")

    num_layers = positive_int(text, "num_hidden_layers")
    heads = positive_int(text, "num_attention_heads")
    kv_heads = positive_int(text, "num_key_value_heads")
    expect(heads % kv_heads == 0, ConfigError, "num_key_value_heads", kv_heads,
           f"a divisor of num_attention_heads={heads}")
    k_heads = positive_int(text, "linear_num_key_heads")
    v_heads = positive_int(text, "linear_num_value_heads")
    expect(v_heads % k_heads == 0, ConfigError, "linear_num_value_heads", v_heads,
           f"a multiple of linear_num_key_heads={k_heads}")
    head_dim = positive_int(text, "head_dim")
    rope_theta, partial = _rope_fields(text)
    rotary_dim = int(head_dim * partial)
    expect(rotary_dim >= 2 and rotary_dim % 2 == 0, ConfigError, "rope_parameters.partial_rotary_factor", partial,
           f"a factor giving an even rotary dim >= 2 for head_dim={head_dim}")

    mtp_layers = text.get("mtp_num_hidden_layers", 0)
    expect(isinstance(mtp_layers, int) and mtp_layers in (0, 1), ConfigError, "mtp_num_hidden_layers", mtp_layers,
           "0 or 1")
    tie = top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    expect(isinstance(tie, bool), ConfigError, "tie_word_embeddings", tie, "true or false")

    if is_moe:
        moe = dict(
            intermediate_size=0,
            num_experts=positive_int(text, "num_experts"),
            num_experts_per_tok=positive_int(text, "num_experts_per_tok"),
            moe_intermediate_size=positive_int(text, "moe_intermediate_size"),
            shared_expert_intermediate_size=positive_int(text, "shared_expert_intermediate_size"),
        )
        expect(moe["num_experts_per_tok"] <= moe["num_experts"], ConfigError, "num_experts_per_tok",
               moe["num_experts_per_tok"], f"at most num_experts={moe['num_experts']}")
        expect(text.get("norm_topk_prob", True) is True, ConfigError, "norm_topk_prob", text.get("norm_topk_prob"),
               "true (Qwen3.5 MoE renormalises the top-k router weights)")
    else:
        moe = dict(intermediate_size=positive_int(text, "intermediate_size"), num_experts=0,
                   num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0)

    eps = text.get("rms_norm_eps", 1e-6)
    expect(isinstance(eps, (int, float)) and eps > 0, ConfigError, "rms_norm_eps", eps, "a positive number")
    return TargetConfig(
        model_type=model_type,
        is_moe=is_moe,
        vocab_size=positive_int(text, "vocab_size"),
        hidden_size=positive_int(text, "hidden_size"),
        num_hidden_layers=num_layers,
        layer_types=_layer_types(text, num_layers),
        rms_norm_eps=float(eps),
        max_position_embeddings=positive_int(text, "max_position_embeddings", 32768),
        tie_word_embeddings=tie,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=positive_int(text, "linear_key_head_dim"),
        linear_value_head_dim=positive_int(text, "linear_value_head_dim"),
        linear_conv_kernel_dim=positive_int(text, "linear_conv_kernel_dim", 4),
        mtp_num_hidden_layers=mtp_layers,
        eos_token_ids=_eos_ids(top, text),
        weight_prefix=prefix,
        **moe,
    )


DEFAULT_MTP_K = 3  # drafts per verify step with the target's MTP head when k is not given
# k's bound with MTP, as a released DFlash 2 draft's (block_size - 1): both engines' verify steps are sized and
# tested for at most 8 rows a request, and chained MTP drafts past the seventh are rarely accepted
MAX_MTP_K = 7


def resolve_mtp_k(cfg: TargetConfig, requested: int | None) -> int:
    """k for ``speculative_algorithm='mtp'``: the target must have its MTP head, k in ``1 .. MAX_MTP_K``."""
    expect(cfg.mtp_num_hidden_layers == 1, ConfigError, "mtp_num_hidden_layers", cfg.mtp_num_hidden_layers,
           "1 for speculative_algorithm 'mtp' (this target has no MTP head)")
    k = DEFAULT_MTP_K if requested is None else requested
    expect(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_MTP_K, ConfigError,
           "speculative_num_steps", k, f"an integer in 1 .. {MAX_MTP_K} for speculative_algorithm 'mtp'")
    return k
