"""A tiny target (config and random canonical weights, no files) and a tiny draft fitted to it."""

from __future__ import annotations

import pytest
import torch

from dflash2.reference.formats.config import TargetConfig, parse_target_config
from dflash2.reference.model.draft import ReferenceDraft
from dflash2.reference.formats.draft_checkpoint import load_draft
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.formats.weights import expected_target_shapes

TINY_TARGET = {
    "model_type": "qwen3_5_text",
    "vocab_size": 96,
    "hidden_size": 48,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "intermediate_size": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
}


@pytest.fixture(scope="session")
def target_cfg() -> TargetConfig:
    return parse_target_config(dict(TINY_TARGET))


@pytest.fixture(scope="session")
def target_weights(target_cfg) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return {name: torch.randn(shape, generator=gen) / (shape[-1] ** 0.5 if len(shape) > 1 else 1.0)
            for name, shape in expected_target_shapes(target_cfg).items()}


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, target_cfg):
    """Two layers, block 4, window 8 (so the window clips context in small tests), K_sel 16, r 8."""
    return write_tiny_draft(tmp_path_factory.mktemp("draft"), target_cfg, seed=7, num_layers=2, block_size=4,
                            sliding_window=8, dtype=torch.float32)


@pytest.fixture(scope="session")
def draft(draft_dir, target_cfg, target_weights) -> ReferenceDraft:
    cfg, weights = load_draft(draft_dir, target_cfg)
    return ReferenceDraft(cfg, weights, target_weights)

