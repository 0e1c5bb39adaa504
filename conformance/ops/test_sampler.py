"""fast/kernels/sampler.py vs reference/speculative/sampling.py: filtered target probabilities (NUMERIC, support
EXACT) and keyed inverse-CDF draws (EXACT away from CDF near-ties)."""

from __future__ import annotations

import random

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.sampler import (SamplingTensors, sample_torch, sample_triton, target_probs_torch,
                                          target_probs_triton)
from dflash2.reference.request.rng import Purpose, uniform
from dflash2.reference.speculative.sampling import sample_from_probs, target_probs
from dflash2.reference.request.sampling_params import SamplingParams

CDF_TIE = 1e-5  # a draw whose target lies this close (relative) to a CDF step may round either way


def random_params(n: int, rng: random.Random) -> list[SamplingParams]:
    fixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=1),
             SamplingParams(temperature=1.0), SamplingParams(temperature=0.05, top_p=0.9),
             SamplingParams(temperature=1.0, top_k=1000), SamplingParams(temperature=1.0, top_p=1e-6),
             SamplingParams(temperature=3.0, top_k=3, top_p=0.5, seed=2**64 - 1)]
    out = fixed[:n]
    while len(out) < n:
        out.append(SamplingParams(temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.7]),
                                  top_k=rng.choice([-1, -1, 1, 2, 5, 20]),
                                  top_p=rng.choice([1.0, 1.0, 0.95, 0.7, 0.3]),
                                  seed=rng.getrandbits(64)))
    return out


def random_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[1::5, 2] = logits[1::5, 7] = logits[1::5].max(dim=-1).values + 0.5  # tied maxima
    logits[2::5, vocab // 2:] = float("-inf")  # a masked half of the vocabulary
    logits[3::5, :6] = logits[3::5, 0:1]  # a run of equal logits
    return logits


@pytest.mark.parametrize("rows,vocab", [(9, 37), (24, 101)])
def test_target_probs(impl_device, report, rows, vocab):
    impl, device = impl_device
    params = random_params(rows, random.Random(vocab))
    logits = random_logits(rows, vocab, torch.Generator().manual_seed(rows))
    expected = torch.stack([target_probs(logits[b], params[b]) for b in range(rows)])
    fn = pick(impl, target_probs_torch, target_probs_triton)
    got = fn(logits.to(device), SamplingTensors.from_params(params, device)).cpu()
    assert torch.equal(got > 0, expected > 0), "the kept support differs"
    report.numeric("target_probs", got, expected, NUMERIC_BOUND[torch.float32])


def cdf_margin(probs: torch.Tensor, u: float) -> float:
    cdf = torch.cumsum(probs.double(), dim=0)
    return float((cdf - u * cdf[-1]).abs().min() / cdf[-1])


@pytest.mark.parametrize("rows,vocab", [(40, 37), (64, 257)])
def test_sample(impl_device, rows, vocab):
    impl, device = impl_device
    params = random_params(rows, random.Random(rows + vocab))
    logits = random_logits(rows, vocab, torch.Generator().manual_seed(vocab))
    positions = torch.randint(0, 2**32, (rows,), generator=torch.Generator().manual_seed(1))
    fn = pick(impl, sample_torch, sample_triton)
    got = fn(logits.to(device), SamplingTensors.from_params(params, device), positions.to(device)).cpu()
    checked = 0
    for b in range(rows):
        probs = target_probs(logits[b], params[b])
        u = uniform(params[b].seed, int(positions[b]), Purpose.SAMPLE, 0)
        if cdf_margin(probs, u) < CDF_TIE:
            continue
        checked += 1
        assert int(got[b]) == sample_from_probs(probs, u), f"row {b} ({params[b]})"
    assert checked >= rows - 2


def test_sample_purpose_and_slot_key_the_draw(impl_device):
    impl, device = impl_device
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    logits = torch.zeros(6, 50)  # uniform over 50 tokens: the token is floor(50 u)
    positions = torch.arange(6) + 100
    fn = pick(impl, sample_torch, sample_triton)
    got = fn(logits.to(device), SamplingTensors.from_params(params, device), positions.to(device),
             Purpose.BONUS, torch.arange(6).to(device)).cpu()
    expected = [sample_from_probs(torch.full((50,), 0.02), uniform(s, 100 + s, Purpose.BONUS, s)) for s in range(6)]
    assert got.tolist() == expected
