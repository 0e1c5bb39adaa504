"""Tiny random DFlash 2 drafts in the real on-disk format, fitted to a given target.

``write_tiny_draft`` writes a folder that a released draft's loader accepts unchanged:
``config.json`` laid out like a released DFlash 2 draft's (facts sheet section 1: ``qwen3``,
``DFlash2DraftModel``, ``is_causal: false``, all ``sliding_attention``, a ``dflash_config``
block) and ``model.safetensors`` with exactly the draft tensor names. Hidden size, vocabulary and
target layer count come from the target; the mask token defaults to the target's last id.
Weights are a pure function of ``seed``, scaled so that the drafts are not degenerate: norm
weights near one, projections ~ N(0, 1/fan_in), the conv's base kernel near the identity tap
(side s, tap 0 near 1, later taps small) with small dynamic taps, and codebooks sized so the
edge term of the selector is comparable to the unary logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..formats.config import TargetConfig, load_target_config
from ..formats.draft_checkpoint import expected_draft_shapes
from ..formats.draft_config import DRAFT_ARCHITECTURE, DRAFT_MODEL_TYPE, parse_draft_config


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` distinct layers spread evenly over 0 .. L-1 (fewer if the target is shallower)."""
    count = max(1, min(count, num_target_layers))
    if count == 1:
        return [num_target_layers // 2]
    return sorted({round(i * (num_target_layers - 1) / (count - 1)) for i in range(count)})


def tiny_draft_config(target: TargetConfig, *, num_layers: int = 2, block_size: int = 8,
                      target_layer_ids: list[int] | None = None, num_heads: int = 4, num_kv_heads: int = 2,
                      head_dim: int = 16, intermediate_size: int | None = None, sliding_window: int = 2048,
                      conv_kernel_size: int = 2, conv_group_size: int | None = None, selector_rank: int = 8,
                      selector_top_k: int | None = None, mask_token_id: int | None = None,
                      rope_theta: float = 1e7, rms_norm_eps: float = 1e-6) -> dict:
    """The ``config.json`` dict of a tiny draft for ``target``."""
    hidden, vocab = target.hidden_size, target.vocab_size
    if selector_top_k is None:  # the released 16 when the vocabulary allows, else a power of two below it
        selector_top_k = 16 if vocab >= 64 else 1 << max(0, (vocab // 4).bit_length() - 1)
    return {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": DRAFT_MODEL_TYPE,
        "is_causal": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "num_hidden_layers": num_layers,
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or 2 * hidden,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "layer_types": ["sliding_attention"] * num_layers,
        "sliding_window": sliding_window,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rms_norm_eps": rms_norm_eps,
        "vocab_size": vocab,
        "num_target_layers": target.num_hidden_layers,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": default_target_layer_ids(target.num_hidden_layers, num_layers)
            if target_layer_ids is None else list(target_layer_ids),
            "conv_kernel_size": conv_kernel_size,
            "conv_group_size": conv_group_size or math.gcd(16, hidden),
            "selector_rank": selector_rank,
            "selector_top_k": selector_top_k,
        },
    }


def init_draft_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random value for one draft tensor, fp32 on the generator's device, scaled by its role."""
    noise = torch.randn(shape, generator=gen, device=gen.device)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith("base_kernel"):  # [2, K, C]: identity-like tap 0, small later taps
        taps = torch.zeros(shape, device=gen.device)
        taps[:, 0] = 1.0
        return taps + 0.2 * noise
    if name.endswith("kernel_projection.weight"):
        return noise * (0.2 / math.sqrt(shape[1]))
    if name.endswith("codebook"):  # [V, r]: edge ~ sqrt(r) * 0.7^2 * |g|, about unit size
        return 0.7 * noise
    return noise / math.sqrt(shape[-1])  # projections: N(0, 1/fan_in)


def write_tiny_draft(path: str | Path, target_path_or_cfg: str | Path | TargetConfig, seed: int = 0,
                     num_layers: int = 2, block_size: int = 8, target_layer_ids: list[int] | None = None,
                     dtype: torch.dtype = torch.bfloat16, **config_overrides) -> Path:
    """Write a tiny random DFlash 2 draft for the target into ``path``; returns the folder.

    ``config_overrides`` go to :func:`tiny_draft_config` (heads, head_dim, selector sizes, ...).
    The tensors are stored in ``dtype`` (bf16 like the released drafts).
    """
    target = target_path_or_cfg if isinstance(target_path_or_cfg, TargetConfig) \
        else load_target_config(target_path_or_cfg)
    raw = tiny_draft_config(target, num_layers=num_layers, block_size=block_size,
                            target_layer_ids=target_layer_ids, **config_overrides)
    cfg = parse_draft_config(raw, target)  # a factory that writes an unservable draft is a bug
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: init_draft_tensor(name, shape, gen).to(dtype).contiguous()
               for name, shape in expected_draft_shapes(cfg).items()}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
