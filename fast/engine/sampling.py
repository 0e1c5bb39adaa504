"""Per-request sampling of plain decoding and of a prefill's first token, on the kernels of ``fast/kernels/sampling``.

A batch mixes greedy and sampled requests, each with its own temperature, top-k, top-p and seed
(``SamplingTensors``, one row per request); randomness is the reference's keyed Philox: the token at position p
is argmax (greedy) or the inverse-CDF draw of the filtered target distribution with u = uniform(seed, p, SAMPLE,
0) (``reference/generate.py``). A speculative step's verify is ``fast/speculative/verify.py``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose
from dflash2.reference.request.sampling_params import SamplingParams

from ..kernels.sampling.sampler import SamplingTensors, sample


def sampling_tensors(params: Sequence[SamplingParams], device: torch.device) -> SamplingTensors:
    return SamplingTensors.from_params(params, device=device)


def sample_next(logits: Tensor, st: SamplingTensors, positions: Tensor) -> Tensor:
    """The token placed at ``positions [M]`` from the logits row before it  # [M, V] -> [M] long."""
    return sample(logits, st, positions, Purpose.SAMPLE, 0)
