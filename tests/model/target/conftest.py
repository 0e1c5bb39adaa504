"""Fixtures for the reference tests: tiny random transformers targets and their reference twins."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.model.target import ReferenceTarget
from hf_tiny import build_hf_model, canonical_weights, random_mtp_weights, target_config


@dataclass(frozen=True)
class TinyTarget:
    kind: str  # "dense" or "moe"
    hf_model: torch.nn.Module  # the transformers oracle, fp32, eager attention
    cfg: TargetConfig  # parsed from the oracle's config, claiming one MTP layer
    weights: dict[str, torch.Tensor]  # canonical names, including random mtp.* tensors
    target: ReferenceTarget


def _tiny_target(kind: str, seed: int) -> TinyTarget:
    hf_model = build_hf_model(kind, seed)
    cfg = target_config(hf_model, mtp=True)
    weights = canonical_weights(hf_model) | random_mtp_weights(cfg, seed + 1000)
    return TinyTarget(kind, hf_model, cfg, weights, ReferenceTarget(cfg, weights))


@pytest.fixture(scope="session")
def dense_target() -> TinyTarget:
    return _tiny_target("dense", seed=0)


@pytest.fixture(scope="session")
def moe_target() -> TinyTarget:
    return _tiny_target("moe", seed=1)


@pytest.fixture(params=["dense", "moe"])
def tiny_target(request) -> TinyTarget:
    """Each test that takes this runs once on the dense and once on the MoE target."""
    return request.getfixturevalue(f"{request.param}_target")


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(7))
