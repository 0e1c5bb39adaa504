"""Suite-wide settings.

torch runs single-threaded in tests: the models here are tiny, and on a 2-core machine with
anything else running, OpenMP's spinning worker threads made the reference 20x slower
(0.19 s vs 4.3 s for one speculative run of tests/speculative/loop, measured side by side).

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (conformance/ops):
``triton.jit`` reads TRITON_INTERPRET when a kernel module is first imported, and test modules
all over the suite import fast/ modules that import the kernels, so it is set here, before any
test module loads. The engine's CPU path never launches a kernel, so nothing else changes.
"""

import os

import torch

torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
