"""Suite-wide settings.

torch runs single-threaded in tests: the models here are tiny, and on a 2-core machine with
anything else running, OpenMP's spinning worker threads made the reference 20x slower
(0.19 s vs 4.3 s for one speculative run of tests/speculative/loop, measured side by side).

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (conformance/ops):
``triton.jit`` reads TRITON_INTERPRET when a kernel module is first imported, and test modules
all over the suite import fast/ modules that import the kernels, so it is set here, before any
test module loads. The engine's CPU path never launches a kernel, so nothing else changes.

Tolerance tables: the conformance suites report how much of each tolerance every comparison used
(``table_lines``). They go to ``conformance-tables.txt`` in the repository root, and one line of the
summary says so; ``--tolerance-tables`` prints them in the terminal summary too.
"""

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


TABLES_FILE = Path(__file__).resolve().parent / "conformance-tables.txt"


def pytest_addoption(parser):
    parser.addoption("--tolerance-tables", action="store_true",
                     help="print the conformance suites' tolerance tables in the summary (always written to "
                          f"{TABLES_FILE.name})")


def table_lines(config) -> list[tuple[str, list[str]]]:
    """The (title, lines) tables the conformance conftests add at the end of the session."""
    return config.__dict__.setdefault("dflash2_tolerance_tables", [])


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    tables = table_lines(config)
    if not tables:
        return
    text = "\n\n".join(f"== {title}\n" + "\n".join(lines) for title, lines in tables) + "\n"
    TABLES_FILE.write_text(text)
    if config.getoption("--tolerance-tables"):
        for title, lines in tables:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)
    count = sum(len(lines) for _, lines in tables)
    terminalreporter.write_line(f"tolerance tables: {count} lines in {TABLES_FILE} (--tolerance-tables prints them)")
