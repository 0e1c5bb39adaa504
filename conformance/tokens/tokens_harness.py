"""Token-stream comparison of the fast engine with the fp32 reference (docs/tolerances.md, TOKEN_STREAM).

``assert_token_stream``: identical up to the first divergence; there the reference's top two
logits (the reference target run over the prompt and the agreed prefix) must be within the fp32
near-tie bound. Anything after a tie-broken divergence is not compared (the continuations are
different sequences).

``Case``: one request of a batch (prompt ids and sampling parameters). ``reference_alone`` runs it
alone through ``ReferenceRunner`` (plain or speculative, as the engine under test).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.reference.runner import ReferenceRunner
from dflash2.reference.request.sampling_params import SamplingParams

NEAR_TIE_FP32 = 1e-4  # docs/tolerances.md: fp32 near-tie logit gap


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    params: SamplingParams


def top_two_gap(runner: ReferenceRunner, ids: list[int]) -> float:
    logits = runner.target.forward(torch.tensor(ids)).logits[-1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_token_stream(fast: list[int], reference: list[int], runner: ReferenceRunner, prompt: list[int],
                        what: str = "") -> None:
    """TOKEN_STREAM: equal, or equal up to a divergence at a reference near tie."""
    if fast == reference:
        return
    j = next((i for i, (a, b) in enumerate(zip(fast, reference)) if a != b), min(len(fast), len(reference)))
    assert j < min(len(fast), len(reference)), \
        f"{what}: same tokens but different lengths {len(fast)} vs {len(reference)} (a finish condition differs)"
    gap = top_two_gap(runner, prompt + reference[:j])
    assert gap <= NEAR_TIE_FP32, (f"{what}: token {j} is {fast[j]} (fast) vs {reference[j]} (reference), and the "
                                  f"reference's top-two logit gap there is {gap:.3g} > {NEAR_TIE_FP32}\n"
                                  f"fast      {fast}\nreference {reference}")


def reference_alone(runner: ReferenceRunner, case: Case):
    return runner.generate(case.prompt, case.params)
