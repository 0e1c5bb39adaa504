"""Op-level conformance: every fast kernel against its reference twin (``fast/kernels/common/registry.py``).

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors: the repository's root
conftest sets TRITON_INTERPRET=1 before any test module imports a kernel module (the jit decorator
reads it then). With a GPU it stays unset, and the kernels compile for CUDA tensors.

Each test runs over ``impl_device``: (torch, cpu) always, (triton, cpu) under the interpreter,
(torch, cuda) and (triton, cuda) where CUDA exists. Numeric comparisons are collected by the
``report`` fixture and printed at the end of the run (max error, RMS-relative error, fraction of
the bound used).
"""

from __future__ import annotations

import os

import pytest
import torch

from dflash2.fast.kernels.common.triton_compat import HAS_TRITON

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

IMPL_DEVICES = [("torch", "cpu")]
if INTERPRET or not HAS_TRITON:
    IMPL_DEVICES.append(("triton", "cpu"))
if CUDA:
    IMPL_DEVICES += [("torch", "cuda"), ("triton", "cuda")]

_REPORTS: list[tuple[str, str, float, float, float]] = []


@pytest.fixture(params=IMPL_DEVICES, ids=lambda p: f"{p[0]}-{p[1]}")
def impl_device(request):
    impl, device = request.param
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton is not importable (pip install -e '.[test]' installs it)")
    return impl, device


class Report:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def numeric(self, what: str, fast: torch.Tensor, ref: torch.Tensor, bound: float) -> float:
        """Assert rms(fast - ref) / rms(ref) <= bound (NUMERIC); record it and return the fraction used."""
        fast, ref = fast.detach().double().cpu(), ref.detach().double().cpu()
        assert fast.shape == ref.shape, f"{what}: shape {list(fast.shape)} vs {list(ref.shape)}"
        assert torch.isfinite(fast).all(), f"{what}: non-finite values in the fast result"
        max_err = float((fast - ref).abs().max()) if ref.numel() else 0.0
        rms_ref = float(ref.pow(2).mean().sqrt())
        rel = float((fast - ref).pow(2).mean().sqrt()) / max(rms_ref, 1e-30)
        _REPORTS.append((self.nodeid, what, max_err, rel, rel / bound))
        assert rel <= bound, f"{what}: rms-relative error {rel:.3e} > bound {bound:.0e} (max abs {max_err:.3e})"
        return rel / bound


@pytest.fixture
def report(request) -> Report:
    return Report(request.node.nodeid)


def pytest_terminal_summary(terminalreporter, config):
    if not _REPORTS:
        return
    lines = [f"{nodeid.split('::', 1)[-1]:70s} {what:14s} max {max_err:.2e}  rms-rel {rel:.2e}  "
             f"{100 * frac:5.1f}% of bound" for nodeid, what, max_err, rel, frac in _REPORTS]
    config.__dict__.setdefault("dflash2_tolerance_tables", []).append(("op conformance: NUMERIC errors", lines))
