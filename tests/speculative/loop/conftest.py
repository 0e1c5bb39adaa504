"""Tiny real-format targets (dense and MoE, with MTP heads) and DFlash drafts for the speculative tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.model.draft import ReferenceDraft
from dflash2.reference.formats.draft_checkpoint import load_draft
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target
from dflash2.reference.model.mtp import ReferenceMTP
from dflash2.reference.model.target import ReferenceTarget


@dataclass
class TinyStack:
    preset: str
    target: ReferenceTarget
    mtp: ReferenceMTP
    draft_path: object
    target_weights: dict

    def draft(self, k: int | None = None) -> ReferenceDraft:
        cfg, weights = load_draft(self.draft_path, self.target.cfg, k)
        return ReferenceDraft(cfg, weights, self.target_weights)


@pytest.fixture(scope="session", params=["tiny-dense", "tiny-moe"])
def stack(request, tmp_path_factory) -> TinyStack:
    root = tmp_path_factory.mktemp(request.param)
    target_path = write_tiny_target(root / "target", request.param, tokenizer=None)
    draft_path = write_tiny_draft(root / "draft", target_path, seed=3)
    cfg, weights = load_target(target_path)
    return TinyStack(request.param, ReferenceTarget(cfg, weights), ReferenceMTP(cfg, weights), draft_path, weights)
