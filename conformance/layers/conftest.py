"""Layer conformance (fast model vs reference): report the fraction of each tolerance used."""

from __future__ import annotations

from fast_model_harness import REPORT


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("fast model vs reference: max error per quantity")
        for log in REPORT:
            for line in log.lines():
                terminalreporter.write_line(line)
