"""The kernel registry (fast/kernels/common/registry.py) is complete: every entry resolves to its fast callables,
its reference twin and an existing test file, and every module under fast/kernels/ that defines a
Triton kernel is registered."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from dflash2.fast.kernels.common.registry import KERNELS, KernelTwin

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DIR = ROOT / "fast" / "kernels"


def resolve(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def registry_problems(kernels: tuple[KernelTwin, ...], kernel_dir: Path = KERNEL_DIR) -> list[str]:
    problems = []
    names = [k.name for k in kernels]
    problems += [f"duplicate name {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    for k in kernels:
        for path in (*k.fast, k.reference):
            try:
                if not callable(resolve(path)):
                    problems.append(f"{k.name}: {path} is not callable")
            except (ImportError, AttributeError) as e:
                problems.append(f"{k.name}: {path} does not resolve ({e})")
        if not k.fast:
            problems.append(f"{k.name}: no fast callable")
        if not k.reference.startswith("dflash2.reference."):
            problems.append(f"{k.name}: twin {k.reference} is not in the reference")
        if not (ROOT / k.test).is_file() or not Path(k.test).name.startswith("test_"):
            problems.append(f"{k.name}: no test file {k.test}")
    registered = {p.partition(":")[0].rsplit(".", 1)[-1] for k in kernels for p in k.fast}
    for module in sorted(triton_kernel_modules(kernel_dir)):
        if module not in registered:
            problems.append(f"fast/kernels/.../{module}.py defines a Triton kernel but is not registered")
    return problems


def triton_kernel_modules(directory: Path) -> set[str]:
    """Modules with a function decorated by ``triton.jit`` (with or without arguments)."""
    found = set()
    for path in directory.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    if isinstance(target, ast.Attribute) and target.attr == "jit":
                        found.add(path.stem)
    return found


def test_registry_is_complete():
    assert registry_problems(KERNELS) == []


def test_every_test_file_is_named_after_a_registered_pair():
    tests = {Path(k.test).name for k in KERNELS}
    on_disk = {p.name for p in Path(__file__).parent.glob("test_*.py")} - {Path(__file__).name}
    assert on_disk == tests


@pytest.mark.parametrize("planted", ["no_twin", "no_test", "unregistered_module"])
def test_planted_registry_gaps_are_caught(planted, tmp_path):
    kernels, kernel_dir = list(KERNELS), KERNEL_DIR
    first = kernels[0]
    if planted == "no_twin":
        kernels[0] = KernelTwin(first.name, first.fast, "dflash2.reference.request.rng:no_such_function", first.test)
    elif planted == "no_test":
        kernels[0] = KernelTwin(first.name, first.fast, first.reference, "conformance/ops/test_missing.py")
    else:
        for path in KERNEL_DIR.rglob("*.py"):
            (tmp_path / path.name).write_text(path.read_text())
        (tmp_path / "rogue.py").write_text("import triton\n\n@triton.jit\ndef k(x):\n    pass\n")
        kernel_dir = tmp_path
    assert registry_problems(tuple(kernels), kernel_dir) != []
