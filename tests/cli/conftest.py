"""Checkpoints written once per session by ``ft make-tiny`` itself, and helpers to call ``ft``.

``made(preset)`` runs ``ft make-tiny --preset P --out ... --draft-out ...`` in-process on first
use and returns a :class:`Made` (target folder, draft folder, what the command printed).
``ft(*argv)`` runs ``dflash2.cli.main.main`` in-process and returns (exit code, stdout, stderr).
``damaged(preset)`` is a private copy of a made target to break in one precise way.
``forward_calls`` records every target forward pass (a refused request must run none).
``greedy_args(model)`` is the argv of a greedy, eos-ignoring JSON ``ft generate`` on fixed prompt ids.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from dflash2.cli.main import main
from dflash2.reference.model.target import ReferenceTarget

PROMPT_IDS = "5,17,42,99,3"


@dataclass(frozen=True)
class Made:
    preset: str
    target: Path
    draft: Path
    printed: str


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str

    def json(self) -> dict:
        assert self.code == 0, self.err
        return json.loads(self.out)


@pytest.fixture(scope="session")
def made(tmp_path_factory) -> Callable[[str], Made]:
    cache: dict[str, Made] = {}

    def get(preset: str) -> Made:
        if preset not in cache:
            root = tmp_path_factory.mktemp(preset)
            target, draft = root / "target", root / "draft"
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                code = main(["make-tiny", "--preset", preset, "--out", str(target), "--draft-out", str(draft)])
            assert code == 0
            cache[preset] = Made(preset, target, draft, buffer.getvalue())
        return cache[preset]

    return get


@pytest.fixture
def ft(capsys) -> Callable[..., Run]:
    """``ft("generate", "--model", path, ...)``: run the command line in-process."""
    def run(*argv) -> Run:
        capsys.readouterr()  # drop anything printed before
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


@pytest.fixture
def damaged(made, tmp_path) -> Callable[[str], Path]:
    """``damaged(preset)``: a private copy of the preset's target folder (with tokenizer), free to break."""
    def get(preset: str) -> Path:
        copy = tmp_path / f"{preset}-copy"
        shutil.copytree(made(preset).target, copy)
        return copy

    return get


@pytest.fixture
def forward_calls(monkeypatch) -> list:
    """Records every target forward pass: a refused request must not run the model at all."""
    calls: list = []
    original = ReferenceTarget.forward

    def counting(self, *args, **kwargs):
        calls.append(args[0].shape if args else None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ReferenceTarget, "forward", counting)
    return calls


@pytest.fixture(scope="session")
def greedy_args() -> Callable[..., list[str]]:
    """``greedy_args(model)``: the argv of a greedy, eos-ignoring JSON ``ft generate`` on fixed prompt ids."""
    def args(model: Path, prompt_ids: str = PROMPT_IDS, max_tokens: int = 12) -> list[str]:
        return ["generate", "--model", str(model), "--engine", "reference", "--temperature", "0", "--json",
                "--prompt-ids", prompt_ids, "--ignore-eos", "--max-tokens", str(max_tokens)]

    return args
