"""The one kernel dispatch: every op with a Triton (GPU) form is a :class:`KernelOp`, and only it chooses.

An op pairs its torch twin (the form the CPU runs, the one conformance holds to the reference) with one
or more GPU forms, each with the condition under which it takes a call (``fits``: shapes, strides,
dtypes, row counts). A call goes to the first GPU form that fits when Triton is installed and the
call's first tensor argument lives on a CUDA device, and to the torch twin otherwise::

    add_rms_norm = KernelOp("add_rms_norm", add_rms_norm_torch,
                            GpuForm(add_rms_norm_triton, fits=lambda x, update, *_: x.dim() == 2))
    h, u = add_rms_norm(x, update, scale, eps, dtype)

Capture: inside a CUDA-graph capture an op with ``gpu_in_capture`` takes its first GPU form whatever its
``fits`` says (an op whose torch twin reads device values on the host cannot be captured in that form,
and one whose bound was chosen for eager prefill has no reason to leave the GPU form inside a graph).
:meth:`KernelOp.capturable` reports whether every call of the op on a device can be captured; the
engine captures a model only when all the ops it runs say so (``FastTarget.capturable``).

A GPU form with no torch twin of its own (flash-linear-attention's chunked prefill) is still one of the
op's forms: its twin is the op's torch form, which the conformance test compares it with.

:func:`forced_torch` runs every op's torch twin inside a block, on any device (tests, and A/B checks of
a fused kernel against its twin on the GPU); :func:`forced_gpu` the GPU forms, on any device (tests: Triton's
interpreter on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from .triton_compat import HAS_TRITON


def _always(*args, **kwargs) -> bool:
    return True


@dataclass(frozen=True)
class GpuForm:
    """A Triton (or other CUDA) form of an op and when it takes a call (same arguments as the op)."""

    fn: Callable
    fits: Callable[..., bool] = _always


_FORCED: tuple[str, frozenset | None] | None = None  # (form, the ops it applies to, None: all) in a forced block


@contextmanager
def _forcing(form: str, ops) -> Iterator[None]:
    global _FORCED
    previous, _FORCED = _FORCED, (form, None if ops is None else frozenset(ops))
    try:
        yield
    finally:
        _FORCED = previous


def forced_torch(ops: Iterable[KernelOp] | None = None):
    """Within the block ``ops`` (default: every :class:`KernelOp`) run their torch twins, on any device."""
    return _forcing("torch", ops)


def forced_gpu(ops: Iterable[KernelOp] | None = None):
    """Within the block ``ops`` (default: every :class:`KernelOp`) run a GPU form wherever the call fits one, on
    any device: Triton's interpreter runs the kernels on CPU tensors (tests of a model's kernel composition)."""
    return _forcing("gpu", ops)


def on_cuda(args, kwargs) -> bool:
    """The call's first tensor argument (positional, then keyword) lives on a CUDA device. An op's tensors share
    one device; the first is the one its forms are written around (x, q, logits, seeds)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value.is_cuda
    return False


class KernelOp:
    """One compute op: its torch twin, its GPU forms and the rule that picks one per call (module docstring).

    ``torch_capturable``: whether the torch twin can be captured in a CUDA graph (False where it reads
    device values on the host); ``gpu_in_capture``: inside a capture, take the first GPU form whatever its
    ``fits`` (defaults to ``not torch_capturable``).
    """

    def __init__(self, name: str, torch_form: Callable, *gpu_forms: GpuForm, torch_capturable: bool = True,
                 gpu_in_capture: bool | None = None):
        self.name = name
        self.torch_form = torch_form
        self.gpu_forms = gpu_forms
        self.torch_capturable = torch_capturable
        self.gpu_in_capture = (not torch_capturable) if gpu_in_capture is None else gpu_in_capture

    def __repr__(self) -> str:
        return f"KernelOp({self.name!r})"

    def pick(self, *args, **kwargs) -> Callable:
        """The form that runs this call."""
        forced = self._forced()
        if forced == "torch" or not self.gpu_forms or not HAS_TRITON:
            return self.torch_form
        if forced != "gpu" and not on_cuda(args, kwargs):
            return self.torch_form
        # a capture needs CUDA (a CPU build of torch raises on the question: forced_gpu under the interpreter)
        if self.gpu_in_capture and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return self.gpu_forms[0].fn
        for form in self.gpu_forms:
            if form.fits(*args, **kwargs):
                return form.fn
        return self.torch_form

    def _forced(self) -> str | None:
        """The form a forced block imposes on this op, or None."""
        if _FORCED is None or (_FORCED[1] is not None and self not in _FORCED[1]):
            return None
        return _FORCED[0]

    def __call__(self, *args, **kwargs):
        return self.pick(*args, **kwargs)(*args, **kwargs)

    def capturable(self, device: torch.device | str) -> bool:
        """Whether every call of this op on ``device`` can be captured in a CUDA graph."""
        if self.torch_capturable:
            return True
        device = torch.device(device)
        return bool(self.gpu_forms) and HAS_TRITON and device.type == "cuda" and self.gpu_in_capture and (
            self._forced() != "torch")
