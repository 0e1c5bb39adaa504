"""Layer conformance (fast model vs reference): report the fraction of each tolerance used."""

from __future__ import annotations

from fast_model_harness import REPORT


def pytest_terminal_summary(terminalreporter, config):
    if REPORT:
        lines = [line for log in REPORT for line in log.lines()]
        config.__dict__.setdefault("dflash2_tolerance_tables", []).append(("fast model vs reference: max error per quantity", lines))
