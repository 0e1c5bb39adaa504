"""The learning rate of a time-budgeted stage: linear warm-up by steps, cosine decay by time.

    lr(step, f) = peak * min(1, (step + 1) / warmup) * (r + (1 - r) * (1 + cos(pi * f)) / 2)

with f = elapsed / budget in [0, 1] and r = min_lr_ratio. Tying the decay to elapsed time rather
than a step count lets one recipe run on machines of different speed and still end its schedule
when the budget does; a resumed stage carries its elapsed time forward.
"""

from __future__ import annotations

import math


def learning_rate(peak: float, step: int, elapsed_fraction: float, warmup_steps: int, min_lr_ratio: float) -> float:
    f = min(max(elapsed_fraction, 0.0), 1.0)
    warm = min(1.0, (step + 1) / max(warmup_steps, 1))
    return peak * warm * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * f)))
