"""GGUF drafts (arch ``dflash``) -> the same (DraftConfig, tensors) as ``draft_checkpoint.load_draft``.

Written against the files llama.cpp's own converter produces (``tests/formats/gguf/golden``). Names:
``fc``, ``enc.output_norm`` (the context-side ``hidden_norm``), ``output_norm`` (the final ``norm``),
``selector_hidden``/``selector_predecessor``/``selector_successor`` (the codebooks gain a ``.weight``
suffix), per block ``attn_norm``/``ffn_norm``, ``attn_{q,k,v,output}``, ``attn_{q,k}_norm``,
``ffn_{gate,up,down}``, ``attn_conv_base``/``attn_conv_proj``, ``ffn_conv_base``/``ffn_conv_proj``.
Values are stored as they are (the draft's norms are plain ``w``).

Metadata under ``dflash.*`` is turned back into the draft's ``config.json`` fields and validated by
``parse_draft_config`` against the target, so a GGUF draft is refused exactly where its safetensors
source would be. ``dflash.target_layers`` holds each HF target layer id + 1. The window W is
``dflash.attention.sliding_window``: llama.cpp's converter writes it only when the HF config sets
``use_sliding_window``; without it llama.cpp runs the draft with no window at all, which is not the
DFlash 2 forward, so such a file is refused by name rather than given a guessed W.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from .config import TargetConfig
from .draft_checkpoint import expected_draft_shapes
from .draft_config import DRAFT_ARCHITECTURE, DRAFT_MODEL_TYPE, DraftConfig, parse_draft_config
from .errors import CheckpointError, ConfigError
from .gguf_file import ATTENTION_NAMES, GGUFModel, f32_metadata, same_ggml_shape

DRAFT_ARCH = "dflash"
_TOP_NAMES = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "hidden_norm.weight",
    "output_norm.weight": "norm.weight",
    "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
    "selector_predecessor.weight": "candidate_selector.predecessor_codebook",
    "selector_successor.weight": "candidate_selector.successor_codebook",
}
_BLOCK_NAMES = {
    **ATTENTION_NAMES,
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_conv_base": "attention_conv.base_kernel",
    "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
    "ffn_conv_base": "mlp_conv.base_kernel",
    "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# metadata for scalings this forward does not apply -> the config.json field parse_draft_config refuses
_SCALINGS = {"logit_scale": "output_multiplier", "final_logit_softcapping": "final_logit_softcapping",
             "embedding_scale": "input_embedding_scale"}


def gguf_draft_config(model: GGUFModel, target_cfg: TargetConfig, k: int | None = None) -> DraftConfig:
    """The draft's :class:`DraftConfig` from the file's metadata, validated against ``target_cfg``."""
    return parse_draft_config(_config_json(model), target_cfg, k)


def _config_json(model: GGUFModel) -> dict[str, Any]:
    arch = model.arch
    if arch != DRAFT_ARCH:
        raise ConfigError(f"{model.path}: general.architecture={arch!r}: expected a DFlash draft, {DRAFT_ARCH!r}")
    a = DRAFT_ARCH + "."

    def get(key: str, kind: type | tuple = int, default: Any = ...) -> Any:
        return model.get(a + key, kind, default)

    layers = get("block_count")
    window = get("attention.sliding_window", int, None)
    if window is None:
        raise ConfigError(f"{model.path}: metadata key {a + 'attention.sliding_window'!r} is missing; expected the "
                          "DFlash 2 sliding window (llama.cpp's converter writes it when the HF config has "
                          "use_sliding_window: true; without it llama.cpp runs the draft with no window)")
    pattern = get("attention.sliding_window_pattern", list, [True] * layers)
    head_dim = get("attention.key_length")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": f32_metadata(get("rope.freq_base", float))}
    rotary = get("rope.dimension_count", int, head_dim)
    if rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    dflash: dict[str, Any] = {
        "block_size": get("block_size"),
        "mask_token_id": model.get("tokenizer.ggml.mask_token_id", int),
        "target_layer_ids": [i - 1 for i in get("target_layers", list)],
        "conv_kernel_size": get("conv_kernel_size"),
        "conv_group_size": get("conv_group_size"),
        "selector_rank": get("selector_rank"),
        "selector_top_k": get("selector_top_k"),
    }
    for key, field in _SCALINGS.items():
        if a + key in model.metadata:
            dflash[field] = get(key, (int, float))
    raw: dict[str, Any] = {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": DRAFT_MODEL_TYPE,
        "num_hidden_layers": layers,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": head_dim,
        "layer_types": ["sliding_attention" if swa else "full_attention" for swa in pattern],
        "sliding_window": window,
        "rope_parameters": rope,
        "rms_norm_eps": f32_metadata(get("attention.layer_norm_rms_epsilon", float)),
        "dflash_config": dflash,
    }
    if a + "attention.causal" in model.metadata:  # absent: causal, which parse_draft_config refuses
        raw["is_causal"] = get("attention.causal", bool)
    tokens = model.get("tokenizer.ggml.tokens", list, None)
    if tokens is not None:
        raw["vocab_size"] = len(tokens)
    return raw


def load_gguf_draft(path: str | Path, target_cfg: TargetConfig, k: int | None = None,
                    dtype: torch.dtype = torch.float32) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """Read a GGUF draft (a file or the first shard of a split set), fitted to ``target_cfg``."""
    model = GGUFModel(path)
    raw = _config_json(model)
    raw.setdefault("vocab_size", target_cfg.vocab_size)
    cfg = parse_draft_config(raw, target_cfg, k)
    expected = expected_draft_shapes(cfg)
    by_canonical: dict[str, str] = {}
    unexpected: list[str] = []
    for name in model.names():
        canonical = _canonical(name, cfg.num_hidden_layers)
        if canonical is None:
            unexpected.append(name)
        else:
            by_canonical[canonical] = name
    missing = [f"{_gguf_name(c)!r} (canonical {c!r})" for c in expected if c not in by_canonical]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{model.path}: missing tensor {', '.join(missing[:3])}{more} in the draft")
    if unexpected:
        raise CheckpointError(f"{model.path}: unexpected tensor {', '.join(repr(n) for n in sorted(unexpected)[:3])}: "
                              "not part of a DFlash 2 draft with this metadata (a draft has no embedding, "
                              "LM head or reduced vocabulary of its own)")
    tensors: dict[str, torch.Tensor] = {}
    for canonical, shape in expected.items():
        name = by_canonical[canonical]
        if not same_ggml_shape(model.shape(name), shape):
            raise CheckpointError(f"{model.path}: tensor {name!r} (canonical {canonical!r}) has shape "
                                  f"{list(model.shape(name))}, expected {list(shape)} from the metadata")
        tensors[canonical] = model.tensor(name, dtype).reshape(shape)
    return cfg, tensors


def _canonical(name: str, num_layers: int) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _BLOCK.match(name)
    if match is None or int(match[1]) >= num_layers or match[2] not in _BLOCK_NAMES:
        return None
    return f"layers.{match[1]}.{_BLOCK_NAMES[match[2]]}"


def _gguf_name(canonical: str) -> str:
    to_gguf = {v: k for k, v in _TOP_NAMES.items()}
    if canonical in to_gguf:
        return to_gguf[canonical]
    _, layer, rest = canonical.split(".", 2)
    return f"blk.{layer}.{ {v: k for k, v in _BLOCK_NAMES.items()}[rest]}"
