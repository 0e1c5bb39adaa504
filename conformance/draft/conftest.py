"""A tiny real-format target (with MTP) and DFlash 2 drafts fitted to it; the fast side in fp32 on
``DEVICE`` (CUDA when there is one, else the CPU), the reference in fp32 on the CPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.model.draft import ReferenceDraft
from dflash2.reference.formats.draft_checkpoint import load_draft
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target
from dflash2.fast.model.draft import FastDraft
from draft_harness import DEVICE, REPORT


@dataclass
class DraftPair:
    reference: ReferenceDraft
    fast: FastDraft


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("target") / "tiny-dense", "tiny-dense", tokenizer=None)
    cfg, weights = load_target(path)
    return path, cfg, weights


def _draft_pair(tmp_path_factory, tiny_target, name: str, **overrides) -> DraftPair:
    path, target_cfg, target_weights = tiny_target
    folder = write_tiny_draft(tmp_path_factory.mktemp(name), path, seed=5, **overrides)
    cfg, weights = load_draft(folder, target_cfg)
    return DraftPair(ReferenceDraft(cfg, weights, target_weights),
                     FastDraft(cfg, weights, target_weights["embed_tokens.weight"], target_weights["lm_head.weight"],
                               torch.float32, DEVICE))


@pytest.fixture(scope="session")
def small_window(tmp_path_factory, tiny_target) -> DraftPair:
    """Window 24 (ring of 24 + 64 = 88 rows), so short sequences wrap; three layers, block 8."""
    return _draft_pair(tmp_path_factory, tiny_target, "draft-w24", num_layers=3, sliding_window=24)


@pytest.fixture(scope="session")
def released_window(tmp_path_factory, tiny_target) -> DraftPair:
    """The released drafts' window, 2048 (ring of 2112 rows); two layers, block 8."""
    return _draft_pair(tmp_path_factory, tiny_target, "draft-w2048")


def pytest_terminal_summary(terminalreporter, config):
    if REPORT:
        lines = [line for log in REPORT for line in log.lines()]
        config.__dict__.setdefault("dflash2_tolerance_tables", []).append(("fast DFlash / MTP proposers vs reference: max error per quantity", lines))
