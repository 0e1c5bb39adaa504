"""The package boundaries STYLE.md promises, stated by package.

- ``reference/`` never imports the fast engine or Triton.
- ``fast/`` imports from the reference only its shared packages: ``formats`` (config, checkpoints,
  tokenizer, validation), ``tiny`` (the tiny-checkpoint factories) and ``request`` (sampling
  parameters, keyed randomness, stopping, trace). Never ``model`` or ``speculative``: the fast
  engine computes everything itself, and conformance/ compares the two.
- The one deliberate exception: ``ft generate --engine reference`` dispatches to the executable
  spec's runner from ``fast/cli.py``.
- ``train/`` (the training recipe) and ``models/`` (the bundled pair) follow the fast engine's
  rule: ``train/model/`` holds differentiable twins, tested against the reference in tests/train.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHARED_REFERENCE_PACKAGES = {"formats", "tiny", "request"}
PACKAGES = ("reference", "fast", "bench", "train", "models")  # top folders installed as dflash2.<name>
REFERENCE_DISPATCH = {("fast/cli.py", "dflash2.reference.runner")}


def imported_modules(path: Path) -> list[str]:
    """Absolute dotted names a file imports; relative imports resolved against its package."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = ["dflash2", *rel.parts[:-1]] if rel.parts[0] in PACKAGES else list(rel.parts[:-1])
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def python_files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def test_reference_imports_neither_fast_nor_triton():
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in python_files("reference") for name in imported_modules(path)
                 if name.startswith(("dflash2.fast", "triton")) or name.split(".")[0] == "fast"]
    assert offenders == []


def fast_offenders(paths: list[Path]) -> list[str]:
    offenders = []
    for path in paths:
        where = str(path.relative_to(ROOT))
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[:2] != ["dflash2", "reference"] or len(parts) < 3:
                continue
            if parts[2] in SHARED_REFERENCE_PACKAGES or (where, ".".join(parts[:3])) in REFERENCE_DISPATCH:
                continue
            offenders.append(f"{where} imports {name}")
    return offenders


def test_fast_imports_only_the_shared_reference_packages():
    assert fast_offenders(python_files("fast")) == []


def test_train_and_models_import_only_the_shared_reference_packages():
    """The recipe trains its own twins (train/model/); the reference's compute is only its tests' oracle."""
    assert fast_offenders(python_files("train") + python_files("models")) == []


def test_every_reference_module_lives_in_a_package_or_is_a_loop():
    """New reference modules go into a sub-package; only the two loops' entry points sit on top."""
    top_level = {p.stem for p in (ROOT / "reference").glob("*.py")} - {"__init__"}
    assert top_level == {"generate", "runner"}


def test_the_boundary_check_catches_planted_imports(monkeypatch):
    """A fast module importing reference compute (absolutely or relatively) is named; shared ones pass."""
    planted = ROOT / "fast" / "engine" / "planted.py"  # never written: the source is parsed in memory
    source = ("from dflash2.cli.main import main\nimport triton.language as tl\n"
              "from ...reference.model.target import ReferenceTarget\n"
              "from dflash2.reference.speculative import verify\n"
              "from dflash2.reference.formats.config import TargetConfig\n")
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == planted else original(self, *a, **k))
    names = set(imported_modules(planted))
    assert {"dflash2.fast.cli", "triton.language", "dflash2.reference.model.target"} <= names
    assert fast_offenders([planted]) == [
        "fast/engine/planted.py imports dflash2.reference.model.target",
        "fast/engine/planted.py imports dflash2.reference.model.target.ReferenceTarget",
        "fast/engine/planted.py imports dflash2.reference.speculative",
        "fast/engine/planted.py imports dflash2.reference.speculative.verify",
    ]
