"""Programmatic dependent launch (PDL) for the draft's own Triton kernels and the MoE's, on Hopper and later.

Without it, each kernel of a captured step starts only once the previous one has finished and its
launch has gone through; the draft's step is many short kernels, so these gaps are a visible share of
it (measured: bench/results/2026-12-02-h200-perf7/README.md). A kernel launched with PDL (Triton's launch
option ``launch_pdl=True``) may be launched, and its blocks made resident, while the previous kernel still
runs; it then blocks in ``griddepcontrol.wait`` (``gdc_wait``) until that kernel has completed and its writes
are visible. So PDL saves the next kernel's launch and block scheduling, overlapped with the previous one's
tail; no kernel's arithmetic changes, and the results are bitwise the same with it and without it.

The gain is small (bench/kernels/bench_pdl.py; measured: bench/results/2026-12-02-h200-perf8/): inside
a CUDA graph the launches are already back to back, so there is little launch latency left to hide; what
remains between kernels is each one's ramp and tail.

The rule, in every kernel launched with :func:`launch_options`: its first statements, before any
global load or store (weights too: reading them early would be safe, but one rule is easier to check)::

    if PDL:  # a tl.constexpr parameter, pdl_enabled(device) at the launch
        tl.extra.cuda.gdc_wait()  # the previous kernel has completed; its memory is visible
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may be launched now

(a) it never reads what the previous kernel is still writing (read after write); (b) it never
overwrites what the previous kernel still reads (write after read); (c) at most one kernel of the
stream is past its wait at any time, so ``tickets.py``'s shared zeroed counters stay safe: the wait
returns only on the FULL completion of the previous grid, and the trigger comes after the wait, so
the next kernel is launched only once every block of this one has passed its own wait (the previous
kernel is done) and itself passes its wait only once this one has completed. A kernel without PDL
after one with it waits for its completion as usual, and that completion implies the one before.

One exception, listed in :data:`EARLY_READERS` with its reason: a kernel may read, before its wait, memory
that no kernel still running can be writing: its weights, and buffers written at least two kernels back
when the kernel right before it was launched with PDL and triggers after its own wait (so this kernel is
launched only once that one's predecessor has completed). It stores nothing before the wait, and the wait
and the trigger stay together in one ``if PDL:``, so (b) and (c) hold as above. A program of it may return
before the wait when it writes nothing (it counts as triggered); (c)'s "that completion implies the one
before" then rests on the programs that do wait, so every launch must have one. What it gains is what the
first rule gives away: the programs launched under the previous kernel's last wave start their own loads
under its tail. conformance/gpu/test_pdl.py checks both forms.

A second exception, the overlapped MoE down kernel (``moe.py``, "Overlapped split form"; listed in
:data:`EARLY_READERS` for its ids, whose check also covers it): it runs beside the gate/up kernel before it
instead of after it. Each program triggers at once, waits on a per-expert counter that the gate/up programs
release once their h stores are done (acquire; never a grid-wide wait), reads h, stores its partials, and passes
``gdc_wait`` last. It is launched only once every gate/up program has started (they trigger right after their
own waits), so the programs it waits on hold their slots; its completion still implies the gate/up kernel's
(its final wait), so the sum kernel's wait implies both, and (c) holds for every kernel after it. Neither of
the two kernels that overlap touches a ticket counter.

The two calls are written out in each kernel rather than in a ``@triton.jit`` helper here: a jit
function would make this module one of ``registry.py``'s kernel modules, and PDL has no twin. They
sit behind the constexpr so the branch is not compiled when PDL is off, and never runs in Triton's
interpreter (which has no inline asm). ``tl.extra.cuda`` is looked up only when a kernel compiles with
PDL on, so nothing here imports it and this module loads without Triton.

Switches: :data:`SETTINGS` (``pdl``, ``l2_prefetch``), set by the engine from ``EngineConfig.pdl`` and
``EngineConfig.l2_prefetch`` (``ft --no-pdl``, ``--no-l2-prefetch``) through :func:`configure`, or for a block
by :func:`launch_settings` (tests, A/B benchmarks). They are read at every launch, and a launch captured into
a CUDA graph keeps the options it was launched with, so two captures in one process can differ. Whether
the device can (Hopper or later, compiled Triton rather than its interpreter) is cached per device.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from .triton_compat import HAS_TRITON, INTERPRETED


@dataclass(frozen=True)
class LaunchSettings:
    pdl: bool = True  # launch the listed kernels with programmatic dependent launch where the device can
    l2_prefetch: bool = True  # let a kernel issue its bulk L2 prefetch where the device can


SETTINGS = LaunchSettings()


def configure(settings: LaunchSettings) -> None:
    """Set the process's launch settings (the engine does, from its EngineConfig, at startup)."""
    global SETTINGS
    SETTINGS = settings


@contextmanager
def launch_settings(**changes) -> Iterator[LaunchSettings]:
    """Within the block, the launch settings with ``changes`` (``pdl=False``, ``l2_prefetch=False``)."""
    previous = SETTINGS
    configure(replace(previous, **changes))
    try:
        yield SETTINGS
    finally:
        configure(previous)


@functools.lru_cache(maxsize=None)
def _supported(device: torch.device) -> bool:
    """A CUDA device of compute capability >= 9.0 (griddepcontrol is sm_90+), compiled Triton kernels."""
    if not HAS_TRITON or device.type != "cuda" or INTERPRETED:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


# "module:kernel" -> what it reads before its wait and why that is safe (the module docstring's exception)
EARLY_READERS = {
    "moe:_moe_down_kernel": "the expert ids (the router's, two kernels back: the gate/up kernel before it "
                            "triggers after its own wait), to find its expert and whether it leads; overlapped, "
                            "h too, once its expert's counter says it is written (the second exception)",
    "skinny_linear:_skinny_linear_kernel": "its weight (written once, at load), prefetched into L2 before the "
                                           "wait so its first bytes stream under the previous kernel's tail",
}


def pdl_enabled(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` launch with PDL: Hopper or later, compiled Triton, ``SETTINGS.pdl``."""
    if not SETTINGS.pdl:
        return False
    return _supported(torch.device(device))


def l2_prefetch_enabled(device: torch.device | str) -> bool:
    """Whether a kernel may issue sm_90's bulk L2 prefetch (``cp.async.bulk.prefetch.L2``, inline asm): the
    same devices as PDL, and ``SETTINGS.l2_prefetch`` (read at every call, kept by a capture)."""
    if not SETTINGS.l2_prefetch:
        return False
    return _supported(torch.device(device))


def launch_options(device: torch.device | str) -> dict:
    """The launch options to splat into a kernel launch: ``{"launch_pdl": True}`` where PDL is enabled."""
    return {"launch_pdl": True} if pdl_enabled(device) else {}
