"""Triton when it is installed; otherwise stand-ins so the kernel modules still import on a CPU box.

The engine's CPU path uses the torch twins of every kernel and never launches a Triton one, so
Triton is not a runtime dependency. Without it, ``triton.jit`` returns a function that raises when
launched, and ``tl.constexpr`` exists for the annotations.

Loop bounds in these kernels are constexpr (vocabulary size, window, k, K_sel), fixed per model.
That is also what keeps them runnable in Triton 3.6's interpreter under numpy >= 2.4: the
interpreter turns a runtime scalar used as a ``range`` bound into an int with ``int(array)`` of a
one-element array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted").
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _Unavailable:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.fn.__name__}: Triton is not installed")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"{self.fn.__name__}: Triton is not installed")

    class triton:  # noqa: N801 - mirrors the module name
        @staticmethod
        def jit(fn=None, **kwargs):
            return _Unavailable(fn) if fn is not None else _Unavailable

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(int(n) - 1, 0).bit_length()

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    class tl:  # noqa: N801
        class constexpr:  # noqa: N801
            def __init__(self, value=None):
                self.value = value


def _interpreted() -> bool:
    """Whether ``triton.jit`` makes interpreted functions here (TRITON_INTERPRET=1, read through Triton's own
    settings when the kernel modules are imported, which is when ``triton.jit`` decides)."""
    if not HAS_TRITON:
        return False
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


INTERPRETED = _interpreted()  # the kernels run in Triton's interpreter (CPU tensors), not compiled for a GPU
