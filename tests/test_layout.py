"""The package boundaries STYLE.md and docs/architecture.md promise, stated by package.

- ``reference/`` never imports the fast engine, the command line or Triton.
- ``fast/``, ``train/`` and ``models/`` import from the reference only its shared packages: ``formats``
  (config, checkpoints, tokenizer, validation), ``tiny`` (the tiny-checkpoint factories) and ``request``
  (sampling parameters, keyed randomness, stopping, trace). Never ``model`` or ``speculative``: the fast
  engine computes everything itself, and conformance/ compares the two.
- The top packages (``reference``, ``fast``, ``bench``, ``train``, ``models``, ``cli``) import each other
  without a circle; ``cli`` sits above all of them and is the one place ``--engine reference`` reaches the
  executable spec's runner.
- Inside ``fast/`` the arrows point one way: ``kernels`` <- ``weights`` <- ``parallel`` <- ``model`` <- ``speculative`` <-
  ``engine`` <- ``serve`` (and ``llm.py``, ``compare.py`` on top); ``kernels/`` imports nothing above it. Imports under
  ``if TYPE_CHECKING:`` are annotations, not dependencies, and are left out.
- No folder of ``fast/`` holds more than 16 modules; ``fast/`` reads no environment variable (every switch is
  an ``EngineConfig`` field).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHARED_REFERENCE_PACKAGES = {"formats", "tiny", "request"}
PACKAGES = ("reference", "fast", "bench", "train", "models", "cli")  # top folders installed as dflash2.<name>
# each may import only those before it
FAST_LAYERS = ("kernels", "weights", "parallel", "model", "speculative", "engine", "serve")
MAX_MODULES_PER_FOLDER = 16


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth, in source order, except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking(node):
            yield from _import_nodes(ast.Module(body=node.orelse, type_ignores=[]))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            yield from _import_nodes(node)


def imported_modules(path: Path) -> list[str]:
    """Absolute dotted names a file imports; relative imports resolved against its package."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = ["dflash2", *rel.parts[:-1]] if rel.parts[0] in PACKAGES else list(rel.parts[:-1])
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        else:
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def python_files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def test_reference_imports_neither_fast_nor_the_command_line_nor_triton():
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in python_files("reference") for name in imported_modules(path)
                 if name.startswith(("dflash2.fast", "dflash2.cli", "triton")) or name.split(".")[0] == "fast"]
    assert offenders == []


def reference_offenders(paths: list[Path]) -> list[str]:
    """Imports of the reference's compute (anything but its shared packages)."""
    offenders = []
    for path in paths:
        where = str(path.relative_to(ROOT))
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[:2] != ["dflash2", "reference"] or len(parts) < 3 or parts[2] in SHARED_REFERENCE_PACKAGES:
                continue
            offenders.append(f"{where} imports {name}")
    return offenders


def test_fast_train_and_models_import_only_the_shared_reference_packages():
    """The engine computes everything itself; the recipe trains its own twins (train/model/), the reference's
    compute being only its tests' oracle."""
    assert reference_offenders(python_files("fast") + python_files("train") + python_files("models")) == []


def package_graph() -> dict[str, set[str]]:
    """Top package -> the top packages its files import (itself left out)."""
    graph: dict[str, set[str]] = {top: set() for top in PACKAGES}
    for top in PACKAGES:
        for path in python_files(top):
            for name in imported_modules(path):
                parts = name.split(".")
                if parts[0] == "dflash2" and len(parts) > 1 and parts[1] in PACKAGES and parts[1] != top:
                    graph[top].add(parts[1])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle found by a depth-first walk, as the path that closes it."""
    found, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return found


def test_the_top_packages_import_each_other_without_a_circle():
    graph = package_graph()
    assert cycles(graph) == [], graph
    assert not any("cli" in imports for imports in graph.values()), "nothing imports the command line"


def test_the_cycle_check_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def layer_offenders(paths: list[Path]) -> list[str]:
    """``fast/`` files importing a layer above their own (FAST_LAYERS' order)."""
    offenders = []
    for path in paths:
        rel = path.relative_to(ROOT / "fast").parts
        if len(rel) < 2 or rel[0] not in FAST_LAYERS:
            continue
        mine = FAST_LAYERS.index(rel[0])
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[:2] != ["dflash2", "fast"] or len(parts) < 3:
                continue
            if parts[2] in FAST_LAYERS[mine + 1:] or parts[2] in ("llm", "compare"):
                offenders.append(f"fast/{'/'.join(rel)} imports {name}")
    return offenders


def test_inside_fast_the_arrows_point_one_way():
    """kernels <- model <- speculative <- engine <- serve: kernels/ imports nothing above it, and so on."""
    assert layer_offenders(python_files("fast")) == []


def test_no_fast_folder_holds_more_than_sixteen_modules():
    folders = {p.parent for p in python_files("fast")}
    crowded = {str(f.relative_to(ROOT)): n for f in folders
               if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER}
    assert crowded == {}


def test_fast_reads_no_environment_variable():
    """Every engine switch is an EngineConfig field; no module of fast/ reads os.environ or os.getenv."""
    offenders = []
    for path in python_files("fast"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node) in ("os.environ", "os.getenv"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_every_reference_module_lives_in_a_package_or_is_a_loop():
    """New reference modules go into a sub-package; only the two loops' entry points sit on top."""
    top_level = {p.stem for p in (ROOT / "reference").glob("*.py")} - {"__init__"}
    assert top_level == {"generate", "runner"}


def test_the_boundary_checks_catch_planted_imports(monkeypatch):
    """A fast module importing reference compute (absolutely or relatively) or a layer above it is named; shared
    packages and annotations pass."""
    planted = ROOT / "fast" / "model" / "planted.py"  # never written: the source is parsed in memory
    source = ("from dflash2.cli.main import main\nimport triton.language as tl\n"
              "from ...reference.model.target import ReferenceTarget\n"
              "from dflash2.reference.speculative import verify\n"
              "from dflash2.reference.formats.config import TargetConfig\n"
              "from ..engine.runner import ModelRunner\n"
              "if TYPE_CHECKING:\n    from ..speculative.ring import RingPool\n")
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == planted else original(self, *a, **k))
    names = set(imported_modules(planted))
    assert {"dflash2.cli.main", "triton.language", "dflash2.reference.model.target"} <= names
    assert "dflash2.fast.speculative.ring" not in names
    assert reference_offenders([planted]) == [
        "fast/model/planted.py imports dflash2.reference.model.target",
        "fast/model/planted.py imports dflash2.reference.model.target.ReferenceTarget",
        "fast/model/planted.py imports dflash2.reference.speculative",
        "fast/model/planted.py imports dflash2.reference.speculative.verify",
    ]
    assert layer_offenders([planted]) == ["fast/model/planted.py imports dflash2.fast.engine.runner",
                                          "fast/model/planted.py imports dflash2.fast.engine.runner.ModelRunner"]


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def expand_braces(text: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (one brace group at a time, nested groups not used)."""
    match = re.search(r"\{([^{}]*)\}", text)
    if match is None:
        return [text]
    return [expanded for choice in match.group(1).split(",")
            for expanded in expand_braces(text[:match.start()] + choice + text[match.end():])]


def named_paths(markdown: str) -> set[str]:
    """Every backticked path-like name in ``markdown``, braces expanded."""
    return {path for code in re.findall(r"`([^`\s]+)`", markdown) if "/" in code or code.endswith(".py")
            for path in expand_braces(code)}


def test_the_architecture_page_names_every_module_and_its_concept_table_exists():
    """docs/architecture.md stays true: each path of its concept table exists, and every module of reference/,
    fast/ and cli/ is named there (its path, or its path below a folder the text is about: ``engine/runner.py``)."""
    text = ARCHITECTURE.read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    table_paths = set().union(*(named_paths(line) for line in table))
    assert len(table) >= 8 and table_paths
    missing = sorted(p for p in table_paths if "<" not in p and not (ROOT / p.split(" ")[0].rstrip("/")).exists())
    assert missing == [], f"the concept table names paths that do not exist: {missing}"
    named = {n for n in named_paths(text) if "/" in n}
    unnamed = [path.relative_to(ROOT).as_posix() for top in ("reference", "fast", "cli") for path in python_files(top)
               if path.name != "__init__.py" and not any(
                   path.relative_to(ROOT).as_posix() == n or path.as_posix().endswith("/" + n) for n in named)]
    assert unnamed == [], f"docs/architecture.md does not name: {unnamed}"


def test_brace_expansion_of_the_page_check():
    assert expand_braces("fast/kernels/gdn/{a,b}.py") == ["fast/kernels/gdn/a.py", "fast/kernels/gdn/b.py"]
    assert named_paths("see `x/{a,b}.py` and `y.py`, not `word`") == {"x/a.py", "x/b.py", "y.py"}
