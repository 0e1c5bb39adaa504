"""DFlash 2 draft configuration: parsing and startup validation of the draft's ``config.json``.

Shared by the reference and the fast engine, so both serve and refuse exactly the same drafts.
A released draft (facts sheet section 1) looks like::

    architectures: ["DFlash2DraftModel"], model_type: qwen3, is_causal: false,
    num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
    head_dim, layer_types: all "sliding_attention", sliding_window, rope_parameters
    {rope_type: default, rope_theta}, rms_norm_eps, vocab_size, num_target_layers,
    dflash_config {block_size, mask_token_id, target_layer_ids, conv_kernel_size,
                   conv_group_size, selector_rank, selector_top_k}

Refused at startup (the seed's list), each as a :class:`ConfigError` naming the field, its value
and what was expected: no draft path, no folder or no ``config.json``; an architecture other than
``DFlash2DraftModel`` (DFlash 1's ``DFlashDraftModel`` named as such); a quantized draft; a causal
draft (``is_causal`` missing or true: z-lab's MLX reference and vLLM's ``qwen3_dflash.py`` both
treat a ``sliding_attention`` layer without ``is_causal`` as causal); a layer that is not
``sliding_attention``; RoPE scaling, a partial rotary factor or a non-NeoX rotary layout
(vLLM's ``is_neox_style``, an interleaved flag); output scaling this forward does not apply
(``output_multiplier``, ``final_logit_softcapping``, ``input_embedding_scale``, ``logit_scale``);
selector sizes or ``head_dim`` that are not powers of two; a ``conv_group_size`` that does not
divide ``hidden_size``; empty, repeated, negative or out-of-range ``target_layer_ids``; a draft
whose hidden size, vocabulary, mask token or target layer count does not fit the target; and
``k`` (speculative_num_steps) outside ``1 .. block_size - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import TargetConfig, read_config_json
from .errors import ConfigError, expect, is_int, positive_int

DRAFT_ARCHITECTURE = "DFlash2DraftModel"
DFLASH1_ARCHITECTURE = "DFlashDraftModel"
DRAFT_MODEL_TYPE = "qwen3"
ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# flags that ask for an interleaved (GPT-J) rotary layout instead of NeoX halves
INTERLEAVED_ROPE_FLAGS = ("rope_interleaved", "rotary_interleaved", "rope_traditional", "interleaved_rope")


@dataclass(frozen=True)
class DraftConfig:
    """A DFlash 2 draft that fits its target, with k (``speculative_num_steps``) resolved.

    Shapes it implies (C hidden, H/Hkv/D heads, I intermediate, m = len(target_layer_ids),
    K conv taps, G conv group size, r selector rank, V vocab): ``fc [C, m*C]``,
    ``q_proj [H*D, C]``, ``k_proj, v_proj [Hkv*D, C]``, ``o_proj [C, H*D]``,
    ``base_kernel [2, K, C]``, ``kernel_projection [2*K*C/G, C]``, codebooks ``[V, r]``.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int  # W: a block row at s+i sees context positions s+i-W+1 .. s-1
    vocab_size: int
    block_size: int  # S rows per draft forward: [anchor, mask x (S-1)]
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # HF layer indices; the tap is hidden_states[id + 1]
    num_target_layers: int
    conv_kernel_size: int  # K taps
    conv_group_size: int  # G channels share one dynamic tap
    selector_rank: int  # r
    selector_top_k: int  # K_sel candidates per slot
    k: int  # k drafts per step, 1 .. block_size - 1

    @property
    def num_taps(self) -> int:
        """m, the number of tapped target layers."""
        return len(self.target_layer_ids)

    @property
    def num_conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _power_of_two(raw: dict[str, Any], field: str, prefix: str = "") -> int:
    value = positive_int(raw, field, prefix=prefix)
    expect(value & (value - 1) == 0, ConfigError, prefix + field, value, "a power of two")
    return value


def read_draft_config_json(path: str | Path | None) -> dict[str, Any]:
    """The draft folder's parsed ``config.json``, refusing no path, no folder or no file."""
    field = "speculative_draft_model_path"
    expect(path is not None and str(path) != "", ConfigError, field, path,
           "a DFlash 2 draft checkpoint folder (DFlash needs a draft model)")
    folder = Path(path)
    expect(folder.is_dir(), ConfigError, field, str(folder), "an existing draft checkpoint folder")
    expect((folder / "config.json").is_file(), ConfigError, field, str(folder), "a folder holding config.json")
    return read_config_json(folder)


def load_draft_config(path: str | Path | None, target_cfg: TargetConfig, k: int | None = None) -> DraftConfig:
    """Parse and validate the draft's ``config.json`` against its target."""
    return parse_draft_config(read_draft_config_json(path), target_cfg, k)


def _check_identity(raw: dict[str, Any]) -> None:
    arch = raw.get("architectures")
    if isinstance(arch, list) and DFLASH1_ARCHITECTURE in arch:
        raise ConfigError(f"architectures={arch!r}: this is a DFlash 1 draft ({DFLASH1_ARCHITECTURE}); "
                          f"expected a DFlash 2 draft, [{DRAFT_ARCHITECTURE!r}]")
    expect(arch == [DRAFT_ARCHITECTURE], ConfigError, "architectures", arch, f"[{DRAFT_ARCHITECTURE!r}]")
    model_type = raw.get("model_type")
    expect(model_type == DRAFT_MODEL_TYPE, ConfigError, "model_type", model_type,
           f"{DRAFT_MODEL_TYPE!r} (the Qwen3-style layers this forward implements)")
    dflash = raw.get("dflash_config")
    for where, block in (("", raw), ("dflash_config.", dflash or {})):
        expect("quantization_config" not in block, ConfigError, where + "quantization_config",
               block.get("quantization_config"), "absent (quantized drafts are not supported)")


def _check_attention(raw: dict[str, Any], dflash: dict[str, Any], num_layers: int, block_size: int) -> int:
    """Non-causal, all sliding-window layers; returns the window W."""
    is_causal = raw.get("is_causal")
    expect(is_causal is False, ConfigError, "is_causal", is_causal,
           "false (a DFlash 2 block is non-causal; a missing is_causal makes sliding layers causal)")
    if "causal" in dflash:
        expect(dflash["causal"] is False, ConfigError, "dflash_config.causal", dflash["causal"], "false")
    layer_types = raw.get("layer_types")
    expect(isinstance(layer_types, list) and len(layer_types) == num_layers, ConfigError, "layer_types",
           layer_types, f"a list of {num_layers} entries (num_hidden_layers), all 'sliding_attention'")
    for i, kind in enumerate(layer_types):
        expect(kind == "sliding_attention", ConfigError, f"layer_types[{i}]", kind, "'sliding_attention'")
    window = positive_int(raw, "sliding_window")
    expect(window >= block_size, ConfigError, "sliding_window", window,
           f"at least block_size={block_size}, so the window only ever clips context rows")
    if "swa_window_size" in dflash:
        expect(dflash["swa_window_size"] == window, ConfigError, "dflash_config.swa_window_size",
               dflash["swa_window_size"], f"absent or equal to sliding_window={window}")
    return window


def _check_rope(raw: dict[str, Any]) -> float:
    """Plain NeoX RoPE over the whole head; returns theta."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    expect(scaling is None or scaling == {} or (isinstance(scaling, dict) and
           scaling.get("rope_type", scaling.get("type")) == "default" and set(scaling) <= set(ROPE_KEYS)),
           ConfigError, "rope_scaling", scaling, "absent (RoPE scaling is not supported)")
    expect(params is None or isinstance(params, dict), ConfigError, "rope_parameters", params, "an object")
    params = {**(scaling or {}), **(params or {})}
    for key in params:
        expect(key in ROPE_KEYS, ConfigError, f"rope_parameters.{key}", params[key],
               f"absent (only {ROPE_KEYS} are understood; RoPE scaling is not supported)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    expect(rope_type == "default", ConfigError, "rope_parameters.rope_type", rope_type,
           "'default' (RoPE scaling is not supported)")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    expect(_is_num(theta) and theta > 0, ConfigError, "rope_parameters.rope_theta", theta, "a positive number")
    for where, block in (("rope_parameters.", params), ("", raw)):
        factor = block.get("partial_rotary_factor", 1)
        expect(factor == 1, ConfigError, where + "partial_rotary_factor", factor,
               "1 (the draft rotates the whole head)")
    neox = raw.get("is_neox_style", True)
    expect(neox is True, ConfigError, "is_neox_style", neox, "true (NeoX half rotation)")
    for flag in INTERLEAVED_ROPE_FLAGS:
        expect(not raw.get(flag, False), ConfigError, flag, raw.get(flag), "false or absent (NeoX half rotation)")
    return float(theta)


def _check_output_scaling(raw: dict[str, Any], dflash: dict[str, Any]) -> None:
    """Refuse logit or embedding scaling this forward does not apply (seed: 'output scaling')."""
    for where, block in (("dflash_config.", dflash), ("", raw)):
        for field in ("output_multiplier", "input_embedding_scale", "logit_scale"):
            value = block.get(field, 1)
            expect(value == 1, ConfigError, where + field, value, "1 or absent (scaling is not applied)")
        cap = block.get("final_logit_softcapping")
        expect(cap is None or cap == 0, ConfigError, where + "final_logit_softcapping", cap,
               "absent, null or 0 (soft-capping is not applied)")


def _target_layer_ids(dflash: dict[str, Any], target_cfg: TargetConfig) -> tuple[int, ...]:
    field = "dflash_config.target_layer_ids"
    ids = dflash.get("target_layer_ids")
    num_target = target_cfg.num_hidden_layers
    expect(isinstance(ids, list) and len(ids) > 0 and all(is_int(i) for i in ids), ConfigError, field, ids,
           "a non-empty list of target layer indices")
    expect(len(set(ids)) == len(ids), ConfigError, field, ids, "no repeated layer")
    for i in ids:
        expect(0 <= i < num_target, ConfigError, field, ids,
               f"indices in 0 .. {num_target - 1} (the target has num_hidden_layers={num_target})")
    return tuple(ids)


def parse_draft_config(raw: dict[str, Any], target_cfg: TargetConfig, k: int | None = None) -> DraftConfig:
    """Validate a parsed draft ``config.json`` against ``target_cfg``; resolve k (``speculative_num_steps``)."""
    _check_identity(raw)
    dflash = raw.get("dflash_config")
    expect(isinstance(dflash, dict), ConfigError, "dflash_config", dflash, "an object with the DFlash 2 fields")
    d = "dflash_config."

    num_layers = positive_int(raw, "num_hidden_layers")
    hidden = positive_int(raw, "hidden_size")
    expect(hidden == target_cfg.hidden_size, ConfigError, "hidden_size", hidden,
           f"the target's hidden_size={target_cfg.hidden_size}")
    vocab = positive_int(raw, "vocab_size")
    expect(vocab == target_cfg.vocab_size, ConfigError, "vocab_size", vocab,
           f"the target's vocab_size={target_cfg.vocab_size}")
    if "draft_vocab_size" in raw:
        expect(raw["draft_vocab_size"] == vocab, ConfigError, "draft_vocab_size", raw["draft_vocab_size"],
               f"absent or vocab_size={vocab} (no reduced draft vocabulary)")
    if raw.get("num_target_layers") is not None:
        expect(raw["num_target_layers"] == target_cfg.num_hidden_layers, ConfigError, "num_target_layers",
               raw["num_target_layers"], f"the target's num_hidden_layers={target_cfg.num_hidden_layers}")

    block_size = dflash.get("block_size", raw.get("block_size"))
    expect(is_int(block_size) and block_size >= 2, ConfigError, d + "block_size", block_size, "an integer >= 2")
    mask = dflash.get("mask_token_id")
    expect(is_int(mask) and 0 <= mask < target_cfg.vocab_size, ConfigError, d + "mask_token_id", mask,
           f"a token id of the target's vocabulary, 0 .. {target_cfg.vocab_size - 1}")

    heads = positive_int(raw, "num_attention_heads")
    kv_heads = positive_int(raw, "num_key_value_heads")
    expect(heads % kv_heads == 0, ConfigError, "num_key_value_heads", kv_heads,
           f"a divisor of num_attention_heads={heads}")
    head_dim = _power_of_two(raw, "head_dim")
    act = raw.get("hidden_act", "silu")
    expect(act == "silu", ConfigError, "hidden_act", act, "'silu'")
    for field in ("attention_bias", "mlp_bias"):
        expect(not raw.get(field, False), ConfigError, field, raw.get(field), "false (the draft has no biases)")
    expect(not dflash.get("attention_sink_bias", False), ConfigError, d + "attention_sink_bias",
           dflash.get("attention_sink_bias"), "false or absent (attention sinks are not supported)")
    eps = raw.get("rms_norm_eps", 1e-6)
    expect(_is_num(eps) and eps > 0, ConfigError, "rms_norm_eps", eps, "a positive number")

    window = _check_attention(raw, dflash, num_layers, block_size)
    theta = _check_rope(raw)
    _check_output_scaling(raw, dflash)

    taps = positive_int(dflash, "conv_kernel_size", prefix=d)
    expect(taps <= block_size, ConfigError, d + "conv_kernel_size", taps, f"at most block_size={block_size}")
    group = positive_int(dflash, "conv_group_size", prefix=d)
    expect(hidden % group == 0, ConfigError, d + "conv_group_size", group, f"a divisor of hidden_size={hidden}")
    rank = _power_of_two(dflash, "selector_rank", d)
    top_k = _power_of_two(dflash, "selector_top_k", d)
    expect(top_k <= vocab, ConfigError, d + "selector_top_k", top_k, f"at most vocab_size={vocab}")

    if k is None:
        k = block_size - 1
    expect(is_int(k) and 1 <= k <= block_size - 1, ConfigError, "speculative_num_steps",
           k, f"an integer in 1 .. block_size - 1 = {block_size - 1}")

    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=positive_int(raw, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope_theta=theta,
        sliding_window=window,
        vocab_size=vocab,
        block_size=block_size,
        mask_token_id=mask,
        target_layer_ids=_target_layer_ids(dflash, target_cfg),
        num_target_layers=target_cfg.num_hidden_layers,
        conv_kernel_size=taps,
        conv_group_size=group,
        selector_rank=rank,
        selector_top_k=top_k,
        k=k,
    )
