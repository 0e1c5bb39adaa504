"""Configs of the trained pair, and writing it as real HF checkpoint folders (bf16, files <= 16 MB).

The target is written exactly as the tiny-checkpoint factory writes a Qwen3.5 release
(``reference/tiny/target.py``: multimodal ``qwen3_5`` wrapper, ``config.json``,
``generation_config.json``, safetensors with the HF tensor names, the tokenizer files), so the
loaders that serve released checkpoints load it with no special case. The draft is a
``DFlash2DraftModel`` folder as ``reference/tiny/draft.py`` writes one. Both folders are checked
by the project's own loaders before the function returns.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash2.reference.formats.checkpoint import INDEX_FILE
from dflash2.reference.formats.config import TargetConfig, parse_target_config
from dflash2.reference.formats.draft_config import DraftConfig, parse_draft_config
from dflash2.reference.tiny.draft import tiny_draft_config
from dflash2.reference.tiny.target import TinyTargetSpec, tiny_config_json, tiny_generation_config_json
from dflash2.reference.tiny.weights import disk_tensors, write_json, write_safetensors

from .recipe import Recipe

MAX_FILE_BYTES = 15 * 2**20  # under the 16 MB a file may have (the shipped-model budget)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_ids(tokenizer_dir: Path) -> dict:
    """The special ids the config files name, read back from a trained tokenizer folder."""
    from dflash2.reference.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    return {"eos_token_ids": (im_end, eos), "bos_token_id": eos, "pad_token_id": eos}


def target_spec(recipe: Recipe, num_shards: int = 1) -> TinyTargetSpec:
    t = recipe.target
    return TinyTargetSpec(
        kind="dense", vocab_size=recipe.model_vocab_size(), hidden_size=t.hidden_size, num_layers=t.num_layers,
        full_attention_interval=t.full_attention_interval, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        linear_num_key_heads=t.linear_num_key_heads, linear_num_value_heads=t.linear_num_value_heads,
        linear_key_head_dim=t.linear_key_head_dim, linear_value_head_dim=t.linear_value_head_dim,
        intermediate_size=t.intermediate_size, mtp=True, tie_word_embeddings=True, wrapper=True,
        num_shards=num_shards, dtype="bfloat16", max_position_embeddings=t.max_position_embeddings,
        seed=recipe.seed)


def target_config_json(recipe: Recipe, ids: dict) -> dict:
    return tiny_config_json(target_spec(recipe), ids)


def target_config(recipe: Recipe, ids: dict) -> TargetConfig:
    return parse_target_config(target_config_json(recipe, ids))


def draft_config_json(recipe: Recipe, target: TargetConfig) -> dict:
    d = recipe.draft
    return tiny_draft_config(
        target, num_layers=d.num_layers, block_size=d.block_size, target_layer_ids=list(d.target_layer_ids),
        num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
        intermediate_size=d.intermediate_size, sliding_window=d.sliding_window, selector_rank=d.selector_rank,
        selector_top_k=d.selector_top_k, mask_token_id=target.vocab_size - 1)


def draft_config(recipe: Recipe, target: TargetConfig) -> DraftConfig:
    return parse_draft_config(draft_config_json(recipe, target), target)


def write_target(folder: Path, recipe: Recipe, ids: dict, weights: Mapping[str, torch.Tensor],
                 tokenizer_dir: Path) -> Path:
    """The target folder: config, generation config, tokenizer files, bf16 shards of <= 15 MiB."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("model*.safetensors"), folder / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    config = target_config_json(recipe, ids)
    cfg = parse_target_config(config)
    tensors = disk_tensors(cfg, {n: t.detach().cpu().float() for n, t in weights.items()}, "fused", "bfloat16")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_safetensors(folder, tensors, max(1, math.ceil(total / MAX_FILE_BYTES)))
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", tiny_generation_config_json(target_spec(recipe), ids))
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, folder / name)
    _check_target(folder)
    return folder


def write_draft(folder: Path, recipe: Recipe, target: TargetConfig, weights: Mapping[str, torch.Tensor]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = draft_config_json(recipe, target)
    parse_draft_config(raw, target)
    tensors = {n: t.detach().cpu().to(torch.bfloat16).contiguous() for n, t in weights.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total > MAX_FILE_BYTES:
        raise ValueError(f"draft tensors take {total} bytes: over the {MAX_FILE_BYTES}-byte file budget; "
                         "shrink the draft (layers, selector_rank) or shard it")
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _check_draft(folder, target)
    return folder


def _check_target(folder: Path) -> None:
    from dflash2.reference.formats.checkpoint import load_target

    load_target(folder)  # raises CheckpointError naming what is wrong


def _check_draft(folder: Path, target: TargetConfig) -> None:
    from dflash2.reference.formats.draft_checkpoint import load_draft

    load_draft(folder, target)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())
