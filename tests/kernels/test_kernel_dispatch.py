"""fast/kernels/common/dispatch.py: which form of a KernelOp takes a call, and what it says about capture.

The forms here are recording stubs, so each test sees the choice itself rather than a numeric result.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.kernels.common import dispatch
from dflash2.fast.kernels.common.dispatch import GpuForm, KernelOp, forced_gpu, forced_torch


def recording_op(**kwargs) -> tuple[KernelOp, list[str]]:
    calls: list[str] = []
    op = KernelOp("probe", lambda x: calls.append("torch") or "torch",
                  GpuForm(lambda x: calls.append("wide") or "wide", fits=lambda x: x.shape[-1] >= 8),
                  GpuForm(lambda x: calls.append("any") or "any"), **kwargs)
    return op, calls


@pytest.fixture
def triton_installed(monkeypatch):
    monkeypatch.setattr(dispatch, "HAS_TRITON", True)


def test_cpu_tensors_take_the_torch_twin(triton_installed):
    op, calls = recording_op()
    assert op(torch.zeros(2, 16)) == "torch"
    assert calls == ["torch"]


def test_forced_gpu_takes_the_first_form_that_fits(triton_installed):
    op, _ = recording_op()
    with forced_gpu():
        assert op(torch.zeros(2, 16)) == "wide"
        assert op(torch.zeros(2, 4)) == "any"  # the wide form does not fit: the next one does


def test_no_fitting_form_falls_back_to_the_torch_twin(triton_installed):
    op = KernelOp("narrow_only", lambda x: "torch", GpuForm(lambda x: "gpu", fits=lambda x: x.shape[-1] >= 8))
    with forced_gpu():
        assert op(torch.zeros(1, 4)) == "torch"
        assert op(torch.zeros(1, 8)) == "gpu"


def test_forced_blocks_nest_and_apply_only_to_the_named_ops(triton_installed):
    op, _ = recording_op()
    other, _ = recording_op()
    x = torch.zeros(2, 16)
    with forced_gpu():
        with forced_torch([op]):
            assert op(x) == "torch"
            assert other(x) == "torch"  # the inner block names only op; outside it nothing is forced
        assert op(x) == "wide"  # the outer block is back
    assert op(x) == "torch"


def test_without_triton_every_call_takes_the_torch_twin(monkeypatch):
    monkeypatch.setattr(dispatch, "HAS_TRITON", False)
    op, _ = recording_op()
    with forced_gpu():
        assert op(torch.zeros(2, 16)) == "torch"


def test_the_first_tensor_argument_decides_the_device():
    meta = torch.empty(0, device="meta")
    assert not dispatch.on_cuda((1, "x"), {})
    assert not dispatch.on_cuda((meta,), {})
    assert not dispatch.on_cuda((), {"x": torch.zeros(1)})


def test_capturable_follows_the_torch_twin_then_the_gpu_forms(monkeypatch, triton_installed):
    plain, _ = recording_op()
    assert plain.capturable("cpu") and plain.capturable("cuda")
    host_reading, _ = recording_op(torch_capturable=False)
    assert host_reading.gpu_in_capture  # defaults to the GPU form inside a capture
    assert host_reading.capturable("cuda")
    assert not host_reading.capturable("cpu")
    with forced_torch([host_reading]):
        assert not host_reading.capturable("cuda")  # the torch twin it would run cannot be captured
    monkeypatch.setattr(dispatch, "HAS_TRITON", False)
    assert not host_reading.capturable("cuda")
    torch_only = KernelOp("torch_only", lambda x: x, torch_capturable=False)
    assert not torch_only.capturable("cuda")


def test_inside_a_capture_gpu_in_capture_ops_skip_fits(monkeypatch, triton_installed):
    monkeypatch.setattr(dispatch, "on_cuda", lambda args, kwargs: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    op, _ = recording_op(gpu_in_capture=True)
    assert op(torch.zeros(2, 4)) == "wide"  # the first GPU form, though it does not fit outside a capture
    eager_bound, _ = recording_op()
    assert eager_bound(torch.zeros(2, 4)) == "any"


def test_forced_gpu_on_a_cpu_build_asks_no_capture_question(monkeypatch, triton_installed):
    """Without CUDA there is no capture: a gpu_in_capture op under forced_gpu picks by ``fits`` and never asks
    torch.cuda (a CPU build of torch raises on the question)."""
    def refuse():
        raise AssertionError("asked whether a stream is capturing without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", refuse)
    op, _ = recording_op(gpu_in_capture=True)
    with forced_gpu([op]):
        assert op(torch.zeros(2, 4)) == "any"


def test_every_layer_op_is_a_kernel_op_with_its_own_name():
    from dflash2.fast.model.attention import FastAttention
    from dflash2.fast.model.gdn import FastGDN
    from dflash2.fast.model.mlp import FastMLP
    from dflash2.fast.model.moe import FastMoE
    ops = {op for cls in (FastAttention, FastGDN, FastMLP, FastMoE) for op in cls.ops}
    assert len(ops) >= 10 and all(isinstance(op, KernelOp) and op.name for op in ops)
    assert len({op.name for op in ops}) == len(ops)
