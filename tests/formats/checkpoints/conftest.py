"""Tiny checkpoints written once per session, and private copies of them to damage."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest

from dflash2.reference.tiny.target import write_tiny_target


@pytest.fixture(scope="session")
def written(tmp_path_factory) -> Callable[[str], Path]:
    """``written(preset)``: the preset's folder (no tokenizer files), written on first use."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = write_tiny_target(tmp_path_factory.mktemp(name), name, tokenizer=None)
        return cache[name]

    return get


@pytest.fixture
def copy_of(written, tmp_path) -> Callable[[str], Path]:
    """``copy_of(preset)``: a private copy of the preset's folder, free to damage."""
    def get(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(written(name), target)
        return target

    return get
