"""Tiny deterministic target checkpoints in the real Qwen3.5 HF format (tests, demos, ``ft make-tiny``).

A :class:`TinyTargetSpec` fixes every size and layout choice; :func:`write_tiny_target` writes
``config.json`` and ``generation_config.json`` with the field names Qwen3.5 releases ship
(``text_config`` under the multimodal wrapper, ``rope_parameters`` with ``mrope_section``,
``layer_types``, ``mtp_num_hidden_layers``...), the safetensors files (one file or shards with an
index; experts fused or one tensor per expert; fp32 or bf16, bf16 keeping ``linear_attn.A_log``
and ``linear_attn.norm.weight`` in fp32 as the Qwen3.5 releases do) and, through
``reference/tiny/tokenizer.py``, the tokenizer. transformers loads the result (``tests/formats/checkpoints``).

Weights (``reference/tiny/weights.py``) are a pure function of (config, seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats.checkpoint import INDEX_FILE
from ..formats.config import TargetConfig, parse_target_config
from .weights import disk_tensors, tiny_target_weights, write_json, write_safetensors
from ..formats.weights import expected_target_shapes

__all__ = ["PRESETS", "TinyTargetSpec", "describe", "disk_tensors", "resolve_spec",
           "tiny_config_json", "tiny_generation_config_json", "tiny_target_config", "tiny_target_weights",
           "write_tiny_target"]

QWEN_VOCAB_SIZE = 248320
# Special ids of the Qwen3.5 tokenizer: <|endoftext|> and <|im_end|>; the wrapper's vision ids.
QWEN_ENDOFTEXT_ID = 248044
QWEN_IM_END_ID = 248046
QWEN_VISION_IDS = dict(vision_start_token_id=248053, vision_end_token_id=248054, image_token_id=248056,
                       video_token_id=248057)
# Written as the Qwen3.5 releases do; fixed, so the bytes do not depend on the installed transformers.
TRANSFORMERS_VERSION = "4.57.1"


@dataclass(frozen=True)
class TinyTargetSpec:
    """Every choice behind one tiny target checkpoint. Sizes follow :class:`TargetConfig`'s names."""

    kind: str = "dense"  # 'dense' | 'moe'
    vocab_size: int = 512
    hidden_size: int = 40
    num_layers: int = 4
    layer_types: tuple[str, ...] | None = None  # None: every full_attention_interval-th layer is full
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 24
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1e7
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 8
    linear_value_head_dim: int = 12
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 72  # dense MLP
    num_experts: int = 6
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 20
    shared_expert_intermediate_size: int = 28
    mtp: bool = True
    tie_word_embeddings: bool = False
    wrapper: bool = True  # multimodal qwen3_5 / qwen3_5_moe with text_config; False: flat *_text
    expert_format: str = "fused"  # 'fused' | 'per_expert'
    num_shards: int = 1
    dtype: str = "float32"  # 'float32' | 'bfloat16' on disk
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    seed: int = 0
    # Special ids; None: those of the tokenizer written (or, without one, of natural_tokenizer's kind).
    eos_token_ids: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None


PRESETS: dict[str, TinyTargetSpec] = {
    # Six layers (two full-attention), odd sizes, MTP, multimodal wrapper: the default test target.
    "tiny-dense": TinyTargetSpec(num_layers=6, full_attention_interval=3),
    # MoE: 6 experts, top-2, shared expert, GDN value heads 3x key heads.
    "tiny-moe": TinyTargetSpec(kind="moe", num_layers=4, full_attention_interval=2, linear_num_value_heads=6,
                               linear_value_head_dim=8, seed=1),
    # Flat text-only layouts and the other storage choices.
    "tiny-dense-text": TinyTargetSpec(num_layers=4, full_attention_interval=2, wrapper=False,
                                      tie_word_embeddings=True, mtp=False, num_shards=2, dtype="bfloat16", seed=2),
    "tiny-moe-text": TinyTargetSpec(kind="moe", num_layers=4, full_attention_interval=2, wrapper=False,
                                    expert_format="per_expert", num_shards=3, seed=3),
    # The real Qwen3.5 vocabulary (and tokenizer), otherwise tiny; tied bf16 embeddings keep it ~16 MB.
    "tiny-dense-qwen-vocab": TinyTargetSpec(vocab_size=QWEN_VOCAB_SIZE, hidden_size=32, num_layers=4,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                            linear_num_key_heads=1, linear_num_value_heads=2,
                                            linear_key_head_dim=16, linear_value_head_dim=16,
                                            intermediate_size=64, tie_word_embeddings=True, dtype="bfloat16",
                                            seed=4),
    # Hidden width 256, for llama.cpp's quantizer (scripts/gguf_oracle.sh): K-quant and IQ blocks are 256 wide,
    # so every matrix reading the residual stream quantizes to the asked type; the ones reading a narrower width
    # (attn_output 48, ssm_out 40, ffn_down 24) are no multiple of 32 and llama.cpp stores them as F16.
    # GDN key and value heads of one size (llama.cpp's qwen35 requires it); tied embeddings, no MTP: small files.
    "tiny-dense-256": TinyTargetSpec(hidden_size=256, num_layers=2, full_attention_interval=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                                     linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=20,
                                     linear_value_head_dim=20, intermediate_size=24, mtp=False,
                                     tie_word_embeddings=True, seed=5),
    "tiny-moe-256": TinyTargetSpec(kind="moe", hidden_size=256, num_layers=2, full_attention_interval=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                                   linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=20,
                                   linear_value_head_dim=20, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=24, shared_expert_intermediate_size=24, mtp=False,
                                   tie_word_embeddings=True, seed=6),
}


def resolve_spec(spec: TinyTargetSpec | str) -> TinyTargetSpec:
    """A spec, or the preset of that name."""
    if isinstance(spec, TinyTargetSpec):
        return spec
    if spec not in PRESETS:
        raise ValueError(f"unknown tiny target preset {spec!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[spec]


# --- config.json ---------------------------------------------------------------------------------


def _layer_types(spec: TinyTargetSpec) -> list[str]:
    if spec.layer_types is not None:
        return list(spec.layer_types)
    interval = spec.full_attention_interval
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(spec.num_layers)]


def _mrope_section(rotary_dim: int) -> list[int]:
    """Split the rotary frequencies (rotary_dim / 2) over (t, h, w) as Qwen3.5 does: 64 -> [11, 11, 10]."""
    half = rotary_dim // 2
    base, extra = divmod(half, 3)
    return [base + (1 if k < extra else 0) for k in range(3)]


def natural_tokenizer(spec: TinyTargetSpec) -> str:
    """The tokenizer kind a spec is made for: ``'qwen3.5'`` with the real vocabulary, else ``'small'``."""
    return "qwen3.5" if spec.vocab_size >= QWEN_VOCAB_SIZE else "small"


def _default_special_ids(spec: TinyTargetSpec) -> dict[str, Any]:
    """The ids of the spec's natural tokenizer, so ``config.json`` does not depend on whether the
    tokenizer files are written: stop on ``<|im_end|>`` and ``<|endoftext|>``, pad and bos
    ``<|endoftext|>`` (as Qwen3.5's generation_config.json)."""
    if natural_tokenizer(spec) == "qwen3.5":
        endoftext, im_end = QWEN_ENDOFTEXT_ID, QWEN_IM_END_ID
    else:
        from . import tokenizer as tf  # the small tokenizer: 256 bytes, the merges, then the specials

        first_special = 256 + tf.SMALL_NUM_MERGES
        endoftext = first_special + tf.SMALL_SPECIAL_TOKENS.index(tf.ENDOFTEXT)
        im_end = first_special + tf.SMALL_SPECIAL_TOKENS.index(tf.IM_END)
    return dict(eos_token_ids=(im_end, endoftext), bos_token_id=endoftext, pad_token_id=endoftext)


def _special_ids(spec: TinyTargetSpec, tokenizer_ids: dict[str, Any] | None) -> dict[str, Any]:
    """Spec's explicit ids, else the written tokenizer's, else the natural tokenizer's."""
    ids = dict(_default_special_ids(spec))
    ids.update(tokenizer_ids or {})
    ids.update({k: getattr(spec, k) for k in ids if getattr(spec, k) is not None})
    top = max(ids["eos_token_ids"] + (ids["bos_token_id"], ids["pad_token_id"]))
    if top >= spec.vocab_size:
        raise ValueError(f"special token id {top} does not fit vocab_size={spec.vocab_size}; "
                         "set the spec's eos_token_ids, bos_token_id and pad_token_id")
    return ids


def tiny_config_json(spec: TinyTargetSpec | str, tokenizer_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` content of a spec, laid out as the Qwen3.5 releases ship it."""
    spec = resolve_spec(spec)
    _check_spec(spec)
    moe = spec.kind == "moe"
    ids = _special_ids(spec, tokenizer_ids)
    rotary_dim = int(spec.head_dim * spec.partial_rotary_factor)
    text: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": ids["bos_token_id"],
        "dtype": spec.dtype,
        "eos_token_id": ids["eos_token_ids"][-1],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "layer_types": _layer_types(spec),
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": spec.max_position_embeddings,
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "mtp_num_hidden_layers": 1 if spec.mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "pad_token_id": None,
        "partial_rotary_factor": spec.partial_rotary_factor,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": _mrope_section(rotary_dim),
            "partial_rotary_factor": spec.partial_rotary_factor,
            "rope_theta": spec.rope_theta,
            "rope_type": "default",
        },
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    if spec.layer_types is None:
        text["full_attention_interval"] = spec.full_attention_interval
    if moe:
        text.update(moe_intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts,
                    num_experts_per_tok=spec.num_experts_per_tok, output_router_logits=False,
                    router_aux_loss_coef=0.001, shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    else:
        text["intermediate_size"] = spec.intermediate_size
    arch = "Qwen3_5Moe" if moe else "Qwen3_5"
    if not spec.wrapper:
        return {"architectures": [f"{arch}ForCausalLM"], **text, "transformers_version": TRANSFORMERS_VERSION}
    return {
        "architectures": [f"{arch}ForConditionalGeneration"],
        **_vision_token_ids(spec),
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "transformers_version": TRANSFORMERS_VERSION,
        "vision_config": {  # a tiny tower: the checkpoint carries no vision weights
            "deepstack_visual_indexes": [],
            "depth": 1,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 16,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 32,
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "num_heads": 2,
            "num_position_embeddings": 16,
            "out_hidden_size": spec.hidden_size,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


def _vision_token_ids(spec: TinyTargetSpec) -> dict[str, int]:
    """The real ids with the real vocabulary; otherwise the last four ids (unused by text-only decoding)."""
    if spec.vocab_size >= QWEN_VOCAB_SIZE:
        return dict(QWEN_VISION_IDS)
    return {name: spec.vocab_size - 5 + k for k, name in enumerate(sorted(QWEN_VISION_IDS))}


def tiny_generation_config_json(spec: TinyTargetSpec | str,
                                tokenizer_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """``generation_config.json`` as Qwen3.5 ships it (sampling defaults, every eos id)."""
    spec = resolve_spec(spec)
    ids = _special_ids(spec, tokenizer_ids)
    return {
        "bos_token_id": ids["bos_token_id"],
        "do_sample": True,
        "eos_token_id": list(ids["eos_token_ids"]),
        "pad_token_id": ids["pad_token_id"],
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": TRANSFORMERS_VERSION,
    }


def tiny_target_config(spec: TinyTargetSpec | str) -> TargetConfig:
    """The :class:`TargetConfig` the loader will parse from this spec's ``config.json``."""
    return parse_target_config(tiny_config_json(spec))


def _check_spec(spec: TinyTargetSpec) -> None:
    if spec.kind not in ("dense", "moe"):
        raise ValueError(f"TinyTargetSpec.kind={spec.kind!r}: expected 'dense' or 'moe'")
    if spec.expert_format not in ("fused", "per_expert"):
        raise ValueError(f"TinyTargetSpec.expert_format={spec.expert_format!r}: expected 'fused' or 'per_expert'")
    if spec.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"TinyTargetSpec.dtype={spec.dtype!r}: expected 'float32' or 'bfloat16'")
    if spec.num_shards < 1:
        raise ValueError(f"TinyTargetSpec.num_shards={spec.num_shards}: expected at least 1")


def write_tiny_target(path: str | Path, spec: TinyTargetSpec | str = "tiny-dense",
                      tokenizer: str | None = "auto") -> Path:
    """Write a tiny target checkpoint folder and return its path.

    The folder is created if needed; weight files of an earlier write there are replaced.

    ``tokenizer``: ``'small'``, ``'qwen3.5'``, ``None`` (no tokenizer files) or ``'auto'``
    (``'qwen3.5'`` for the real 248320 vocabulary, else ``'small'``); written by
    ``dflash2.reference.tiny.tokenizer.write_tokenizer``. Its special ids fill the spec's unset ones.
    """
    spec = resolve_spec(spec)
    _check_spec(spec)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:  # a previous write's weights
        stale.unlink(missing_ok=True)
    if tokenizer == "auto":
        tokenizer = natural_tokenizer(spec)
    tokenizer_ids = _write_tokenizer(path, tokenizer, spec.vocab_size) if tokenizer is not None else None

    config = tiny_config_json(spec, tokenizer_ids)
    cfg = parse_target_config(config)
    weights = tiny_target_weights(cfg, spec.seed)
    write_safetensors(path, disk_tensors(cfg, weights, spec.expert_format, spec.dtype), spec.num_shards)
    write_json(path / "config.json", config)
    write_json(path / "generation_config.json", tiny_generation_config_json(spec, tokenizer_ids))
    return path


def _write_tokenizer(path: Path, kind: str, vocab_size: int) -> dict[str, Any]:
    """Write tokenizer files through ``reference/tiny/tokenizer.py``; return its special ids, checking it fits."""
    from .tokenizer import write_tokenizer

    info = write_tokenizer(path, kind)
    if info.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {kind!r} has {info.vocab_size} ids but the spec's vocab_size is {vocab_size}; "
                         "the model's vocabulary must cover the tokenizer's")
    return dict(eos_token_ids=info.eos_token_ids, bos_token_id=info.bos_token_id, pad_token_id=info.pad_token_id)


# --- description ---------------------------------------------------------------------------------


def describe(spec: TinyTargetSpec | str | None = None) -> str:
    """One line per preset (or for the given spec or preset): layout, sizes and bytes on disk."""
    if spec is None:
        return "\n".join(f"{name}: {describe(s)}" for name, s in PRESETS.items())
    spec = resolve_spec(spec)
    cfg = tiny_target_config(spec)
    pattern = "".join("F" if t == "full_attention" else "L" for t in cfg.layer_types)
    if cfg.is_moe:
        mlp = f"E={cfg.num_experts} top-{cfg.num_experts_per_tok} I={cfg.moe_intermediate_size} " \
              f"shared={cfg.shared_expert_intermediate_size} ({spec.expert_format})"
    else:
        mlp = f"I={cfg.intermediate_size}"
    element = 4 if spec.dtype == "float32" else 2
    size = sum(math.prod(s) for n, s in expected_target_shapes(cfg).items()
               if not (n == "lm_head.weight" and cfg.tie_word_embeddings)) * element
    return (f"{cfg.model_type} V={cfg.vocab_size} C={cfg.hidden_size} L={cfg.num_hidden_layers} [{pattern}] "
            f"H={cfg.num_attention_heads} Hkv={cfg.num_key_value_heads} D={cfg.head_dim} rot={cfg.rotary_dim} "
            f"GDN Hk={cfg.linear_num_key_heads} Hv={cfg.linear_num_value_heads} Dk={cfg.linear_key_head_dim} "
            f"Dv={cfg.linear_value_head_dim} K={cfg.linear_conv_kernel_dim} {mlp}"
            f"{' mtp' if cfg.mtp_num_hidden_layers else ''}{' tied' if cfg.tie_word_embeddings else ''} "
            f"{spec.dtype} shards={spec.num_shards} seed={spec.seed} ~{size / 2**20:.1f} MiB")


__all__ = ["PRESETS", "TinyTargetSpec", "describe", "disk_tensors", "resolve_spec", "tiny_config_json",
           "tiny_generation_config_json", "tiny_target_config", "tiny_target_weights", "write_tiny_target"]
