"""The package boundaries STYLE.md promises: the reference never imports the fast engine or Triton,
and the fast engine imports only the reference's shared formats (config, checkpoints, validation)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# reference modules the fast engine may use: formats, validation and shared parameters, no compute
SHARED_REFERENCE_MODULES = {
    "config", "weights", "errors", "checkpoint", "factory", "tiny_weights", "tokenizer", "tokenizer_factory",
    "sampling_params", "rng", "stopping", "trace", "draft_config", "draft_checkpoint", "draft_factory",
}
# the CLI's ``--engine reference`` deliberately dispatches to the executable spec
REFERENCE_DISPATCH = {("cli.py", "runner")}


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] + [f"{base}.{alias.name}" if node.module else f"{base}{alias.name}" for alias in node.names]
    return names


def test_reference_imports_neither_fast_nor_triton():
    offenders = []
    for path in sorted((ROOT / "reference").rglob("*.py")):
        for name in imported_modules(path):
            if name.startswith(("dflash2.fast", "triton")) or name.split(".")[0] == "fast":
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_fast_uses_only_shared_reference_modules():
    offenders = []
    for path in sorted((ROOT / "fast").rglob("*.py")):
        for name in imported_modules(path):
            if not name.startswith("dflash2.reference."):
                continue
            module = name.split(".")[2]
            if module in SHARED_REFERENCE_MODULES or (path.name, module) in REFERENCE_DISPATCH:
                continue
            offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_the_boundary_check_catches_a_planted_import(tmp_path):
    planted = tmp_path / "bad.py"
    planted.write_text("from dflash2.fast.cli import main\nimport triton.language as tl\n")
    assert {"dflash2.fast.cli", "triton.language"} <= set(imported_modules(planted))
