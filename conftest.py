"""Suite-wide settings.

torch runs single-threaded in tests: the models here are tiny, and on a 2-core machine with
anything else running, OpenMP's spinning worker threads made the reference 20x slower
(0.19 s vs 4.3 s for one speculative run of tests/spec, measured side by side).
"""

import torch

torch.set_num_threads(1)
