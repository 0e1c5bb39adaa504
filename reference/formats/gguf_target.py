"""GGUF targets (archs ``qwen35``, ``qwen35moe``) -> the same (TargetConfig, canonical tensors) as safetensors.

Written against the files llama.cpp's own ``convert_hf_to_gguf.py`` produces (the golden files in
``tests/formats/gguf/golden`` come from it), undoing each of its transforms exactly:

- names: ``token_embd`` -> ``embed_tokens``, ``output`` -> ``lm_head`` (absent: tied embeddings),
  ``output_norm`` -> ``norm``; per block ``attn_norm``/``post_attention_norm`` -> the two layer norms,
  ``attn_{q,k,v,output}`` and ``attn_{q,k}_norm`` -> ``self_attn.*``; GDN ``attn_qkv`` ->
  ``in_proj_qkv``, ``attn_gate`` -> ``in_proj_z``, ``ssm_beta``/``ssm_alpha`` -> ``in_proj_b``/``in_proj_a``,
  ``ssm_a`` -> ``A_log``, ``ssm_dt.bias`` -> ``dt_bias``, ``ssm_conv1d``, ``ssm_norm``, ``ssm_out``;
  MLP ``ffn_{gate,up,down}``; MoE ``ffn_gate_inp`` (router), ``ffn_{gate,up,down}_exps`` or the fused
  ``ffn_gate_up_exps`` (gate rows first), ``ffn_*_shexp``, ``ffn_gate_inp_shexp``;
- the MTP head is block ``block_count - 1`` (``nextn_predict_layers`` = 1): ``nextn.eh_proj`` -> ``mtp.fc``,
  ``nextn.enorm``/``hnorm``/``shared_head_norm`` -> ``mtp.pre_fc_norm_embedding``/``pre_fc_norm_hidden``/
  ``norm``, the block's other tensors -> ``mtp.layers.0.*``;
- values: zero-centred RMSNorm weights are stored as ``1 + w`` (``ssm_norm`` as ``w``); ``ssm_a`` holds
  ``-exp(A_log)``; ``ssm_conv1d`` is squeezed to ``[channels, K]``; with r = value heads / key heads > 1,
  value heads are stored tiled (``k0v0, k1v0, .., k0v1, ..``) instead of grouped (``k0v0..k0v(r-1), k1v0..``)
  in ``attn_qkv``'s V rows, ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_a``, ``ssm_dt.bias``,
  ``ssm_conv1d``'s V channels and ``ssm_out``'s input columns.

The config is rebuilt from ``<arch>.*`` metadata as the text model's ``config.json`` would say it and
validated by ``parse_target_config``, so a GGUF target is accepted or refused like its safetensors
source. Layer kinds come from ``attention.recurrent_layers`` (``full_attention_interval`` only when it is
absent, as llama.cpp reads them). What the file does not carry: ``model_type`` is the text-only
``qwen3_5_text``/``qwen3_5_moe_text``; ``eos_token_ids`` are the tokenizer's eos (and eot) ids.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from .config import TargetConfig, parse_target_config
from .errors import CheckpointError, ConfigError
from .gguf_file import ATTENTION_NAMES, GGUFModel, f32_metadata, same_ggml_shape
from .weights import expected_target_shapes

TARGET_ARCHS = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}

# GGUF name inside a block -> canonical name inside a layer (``layers.{i}.`` or ``mtp.layers.0.``)
_BLOCK_NAMES = {
    **ATTENTION_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_SPLIT_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight")  # cat on rows -> mlp.experts.gate_up_proj
_MTP_NAMES = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
_TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight",
              "output_norm.weight": "norm.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_target_config(model: GGUFModel) -> TargetConfig:
    """The target's :class:`TargetConfig` from the file's metadata, validated as a ``config.json`` would be."""
    return parse_target_config(_config_json(model))


def _config_json(model: GGUFModel) -> dict[str, Any]:
    arch = model.arch
    if arch not in TARGET_ARCHS:
        raise ConfigError(f"{model.path}: general.architecture={arch!r}: expected a target of one of "
                          f"{sorted(TARGET_ARCHS)}")
    a = arch + "."

    def get(key: str, kind: type | tuple = int, default: Any = ...) -> Any:
        return model.get(a + key, kind, default)

    blocks, mtp = get("block_count"), get("nextn_predict_layers", int, 0)
    layers = blocks - mtp
    recurrent = get("attention.recurrent_layers", list, None)
    if recurrent is None:
        interval = get("full_attention_interval")
        recurrent = [(i + 1) % interval != 0 for i in range(blocks)]
    if len(recurrent) != blocks or any(recurrent[layers:]):
        raise ConfigError(f"{model.path}: {a}attention.recurrent_layers={recurrent!r}: expected {blocks} entries "
                          f"(block_count), the last {mtp} (the MTP block) false")
    head_dim = get("attention.key_length")
    value_length = get("attention.value_length", int, head_dim)
    if value_length != head_dim:
        raise ConfigError(f"{model.path}: {a}attention.value_length={value_length}: expected "
                          f"attention.key_length={head_dim} (one head_dim)")
    value_heads = get("ssm.time_step_rank")
    inner = get("ssm.inner_size")
    if inner % value_heads:
        raise ConfigError(f"{model.path}: {a}ssm.inner_size={inner}: expected a multiple of "
                          f"ssm.time_step_rank={value_heads} (value heads x value head dim)")
    tokens = model.get("tokenizer.ggml.tokens", list, None)
    text: dict[str, Any] = {
        "model_type": TARGET_ARCHS[arch],
        "vocab_size": len(tokens) if tokens is not None else model.shape("token_embd.weight")[0],
        "hidden_size": get("embedding_length"),
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "rms_norm_eps": f32_metadata(get("attention.layer_norm_rms_epsilon", float)),
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in model.names(),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": f32_metadata(get("rope.freq_base", float)),
                            "partial_rotary_factor": get("rope.dimension_count") / head_dim},
        "linear_num_key_heads": get("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": get("ssm.conv_kernel"),
        "mtp_num_hidden_layers": mtp,
        "eos_token_id": gguf_eos_ids(model),
    }
    if arch == "qwen35moe":
        text.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                    moe_intermediate_size=get("expert_feed_forward_length"),
                    shared_expert_intermediate_size=get("expert_shared_feed_forward_length"))
    else:
        text["intermediate_size"] = get("feed_forward_length")
    return text


def gguf_eos_ids(model: GGUFModel) -> list[int]:
    """The metadata's eos and eot ids, in that order, without repeats."""
    ids = [model.get(key, int, None) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def load_gguf_target(path: str | Path,
                     dtype: torch.dtype = torch.float32) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    """Read a GGUF target (a file, or the first shard of a split set): its config and every canonical
    tensor in ``dtype``, as ``checkpoint.load_target`` gives them from safetensors."""
    model = GGUFModel(path)
    cfg = gguf_target_config(model)
    expected = expected_target_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for canonical, names in plan_gguf_target(cfg, model).items():
        tensors[canonical] = read_canonical(cfg, model, canonical, names, expected[canonical]).to(dtype)
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return cfg, tensors


def read_canonical(cfg: TargetConfig, model: GGUFModel, canonical: str, names: tuple[str, ...],
                   shape: tuple[int, ...]) -> torch.Tensor:
    """Canonical tensor ``canonical`` (float32, ``shape``) from the GGUF tensors ``names`` it is read from
    (``plan_gguf_target``): dequantized, split gate/up halves concatenated per expert, the converter undone."""
    stored = [model.tensor(name) for name in names]
    tensor = undo_converter(cfg, canonical, stored[0] if len(stored) == 1 else torch.cat(stored, dim=1))
    if not same_ggml_shape(tensor.shape, shape):
        raise CheckpointError(f"{model.path}: tensor {' + '.join(repr(n) for n in names)} (canonical "
                              f"{canonical!r}) gives shape {list(tensor.shape)}, expected {list(shape)} from the "
                              "metadata")
    return tensor.reshape(shape)


def plan_gguf_target(cfg: TargetConfig, model: GGUFModel) -> dict[str, tuple[str, ...]]:
    """The GGUF tensors each canonical tensor is read from (two for split gate/up experts, concatenated
    on rows per expert); refuses missing and unexpected GGUF tensors by name. No data is read."""
    sources: dict[str, str] = {}  # canonical -> GGUF name
    split: dict[str, dict[str, str]] = {}  # layer prefix -> {gate/up GGUF suffix: GGUF name}
    unexpected: list[str] = []
    for name in model.names():
        prefix, suffix = _split_name(cfg, name)
        if prefix is None:
            unexpected.append(name)
        elif suffix in _SPLIT_EXPERTS:
            split.setdefault(prefix, {})[suffix] = name
        else:
            sources[prefix + suffix] = name

    plan: dict[str, tuple[str, ...]] = {}
    missing: list[str] = []
    fused = "mlp.experts.gate_up_proj"
    for canonical in expected_target_shapes(cfg):
        if canonical == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if canonical in sources:
            plan[canonical] = (sources.pop(canonical),)
        elif canonical.endswith(fused) and canonical[:-len(fused)] in split:
            halves = split.pop(canonical[:-len(fused)])
            absent = [suffix for suffix in _SPLIT_EXPERTS if suffix not in halves]
            if absent:
                missing.append(_gguf_name(cfg, canonical, absent[0]))
                continue
            plan[canonical] = tuple(halves[suffix] for suffix in _SPLIT_EXPERTS)
        else:
            missing.append(_gguf_name(cfg, canonical))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{model.path}: missing tensor {', '.join(missing[:3])}{more}")
    unexpected += list(sources.values()) + [n for halves in split.values() for n in halves.values()]
    if unexpected:
        more = f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise CheckpointError(f"{model.path}: unexpected tensor {', '.join(repr(n) for n in sorted(unexpected)[:3])}"
                              f"{more}: not part of a {model.arch!r} target with this metadata")
    return plan


def _split_name(cfg: TargetConfig, name: str) -> tuple[str | None, str]:
    """(canonical layer prefix, GGUF suffix or canonical tail); prefix None for a name with no place."""
    if name in _TOP_NAMES:
        return "", _TOP_NAMES[name]
    match = _BLOCK.match(name)
    if match is None:
        return None, name
    block, suffix = int(match[1]), match[2]
    if block < cfg.num_hidden_layers:
        prefix = f"layers.{block}."
    elif block == cfg.num_hidden_layers and cfg.mtp_num_hidden_layers:
        if suffix in _MTP_NAMES:
            return "", _MTP_NAMES[suffix]
        prefix = "mtp.layers.0."
    else:
        return None, name
    if suffix in _SPLIT_EXPERTS:
        return prefix, suffix
    if suffix in _BLOCK_NAMES:
        return prefix, _BLOCK_NAMES[suffix]
    return None, name


def _gguf_name(cfg: TargetConfig, canonical: str, gguf_suffix: str | None = None) -> str:
    """The GGUF name a canonical tensor is read from, for messages."""
    top = {v: k for k, v in _TOP_NAMES.items()}
    mtp = {v: f"blk.{cfg.num_hidden_layers}.{k}" for k, v in _MTP_NAMES.items()}
    if canonical in top or canonical in mtp:
        return f"{top.get(canonical) or mtp[canonical]!r} (canonical {canonical!r})"
    head, _, tail = canonical.partition("layers.")
    layer, _, rest = tail.partition(".")
    block = cfg.num_hidden_layers if head == "mtp." else int(layer)
    suffix = gguf_suffix or {v: k for k, v in _BLOCK_NAMES.items()}[rest]
    also = " or ffn_gate_exps + ffn_up_exps" if rest == "mlp.experts.gate_up_proj" and not gguf_suffix else ""
    return f"'blk.{block}.{suffix}'{also} (canonical {canonical!r})"


def undo_converter(cfg: TargetConfig, canonical: str, stored: torch.Tensor) -> torch.Tensor:
    """The canonical tensor from the value llama.cpp's converter stored for it (shape in torch order)."""
    tensor = stored
    if stored_as_one_plus(canonical):
        tensor = tensor - 1
    if canonical.endswith("linear_attn.A_log"):
        tensor = torch.log(-tensor)
    if canonical.endswith("linear_attn.conv1d.weight"):
        tensor = tensor.unsqueeze(1)  # [channels, K] -> [channels, 1, K]
    return value_heads_grouped(cfg, canonical, tensor)


def stored_as_one_plus(canonical: str) -> bool:
    """Whether the converter stored this weight as ``1 + w``: every RMSNorm weight but the GDN output norm
    (it adds 1 to each HF name ending in ``norm.weight``, the MTP's ``pre_fc_norm_*`` included once renamed
    to ``nextn.enorm``/``hnorm``; the golden files confirm both)."""
    is_norm = canonical.endswith("norm.weight") or canonical.startswith("mtp.pre_fc_norm_")
    return is_norm and not canonical.endswith("linear_attn.norm.weight")


def value_heads_grouped(cfg: TargetConfig, canonical: str, tensor: torch.Tensor) -> torch.Tensor:
    """Undo the converter's reordering of GDN value heads from grouped to tiled order."""
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if "linear_attn." not in canonical or k_heads == v_heads:
        return tensor
    per_key, dv = v_heads // k_heads, cfg.linear_value_head_dim
    qk = 2 * cfg.gdn_key_dim
    if canonical.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # only the V rows / channels
        return torch.cat([tensor[:qk], _to_grouped(tensor[qk:], 0, k_heads, per_key, dv)], dim=0)
    if canonical.endswith("in_proj_z.weight"):
        return _to_grouped(tensor, 0, k_heads, per_key, dv)
    if canonical.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log")):
        return _to_grouped(tensor, 0, k_heads, per_key, 1)
    if canonical.endswith("out_proj.weight"):
        return _to_grouped(tensor, 1, k_heads, per_key, dv)
    return tensor  # linear_attn.norm.weight: one value head's width, shared by all heads


def _to_grouped(tensor: torch.Tensor, dim: int, k_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """Along ``dim`` (v_heads * head_dim entries): tiled ``[per_key, k_heads, head_dim]`` -> grouped
    ``[k_heads, per_key, head_dim]``."""
    shape = list(tensor.shape)
    assert shape[dim] == k_heads * per_key * head_dim, (shape, dim, k_heads, per_key, head_dim)
    tiled = tensor.reshape(*shape[:dim], per_key, k_heads, head_dim, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)

