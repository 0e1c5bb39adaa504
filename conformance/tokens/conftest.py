"""Tiny real-format checkpoints for the token-stream conformance suite, written once per session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target
from dflash2.reference.runner import ReferenceRunner


@dataclass(frozen=True)
class Tiny:
    preset: str
    target: Path
    draft: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    cache: dict[str, Tiny] = {}

    def get(preset: str) -> Tiny:
        if preset not in cache:
            root = tmp_path_factory.mktemp(preset)
            target = write_tiny_target(root / "target", preset)
            cache[preset] = Tiny(preset, target, write_tiny_draft(root / "draft", target, seed=3))
        return cache[preset]

    return get


@pytest.fixture(scope="session")
def reference_runner(tiny):
    cache: dict[tuple, ReferenceRunner] = {}

    def get(preset: str, algorithm: str = "none", k: int | None = None) -> ReferenceRunner:
        key = (preset, algorithm, k)
        if key not in cache:
            t = tiny(preset)
            cache[key] = ReferenceRunner(t.target, speculative_algorithm=algorithm,
                                         draft_model_path=t.draft if algorithm == "dflash" else None,
                                         k=k)
        return cache[key]

    return get
