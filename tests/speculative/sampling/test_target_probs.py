"""The target's filtered distribution: temperature, then top-k, then top-p, and the inverse-CDF draw."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.reference.formats.errors import RequestError
from dflash2.reference.request.rng import Purpose, uniform
from dflash2.reference.speculative.sampling import most_likely_order, sample_from_probs, target_probs
from dflash2.reference.request.sampling_params import SamplingParams


def params(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def test_greedy_is_one_hot_of_the_lowest_maximal_id():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    for p in (params(temperature=0), params(top_k=1, temperature=0.7)):
        assert target_probs(logits, p).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_only_is_softmax():
    logits = torch.randn(11, generator=torch.Generator().manual_seed(0))
    got = target_probs(logits, params(temperature=0.5))
    torch.testing.assert_close(got, torch.softmax(logits / 0.5, -1))


def test_ties_order_by_id():
    probs = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1])
    assert most_likely_order(probs).tolist() == [1, 2, 3, 0, 4]


def test_top_k_keeps_the_k_most_likely_lowest_ids_on_ties():
    logits = torch.log(torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1]))
    got = target_probs(logits, params(top_k=2))
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))
    got = target_probs(logits, params(top_k=4))
    torch.testing.assert_close(got, torch.tensor([0.1, 0.3, 0.3, 0.2, 0.0]) / 0.9)


def test_top_p_applies_after_top_k_on_the_renormalised_mass():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # top-p alone: mass before each token 0, .4, .7, .9 -> keep the first three for p = 0.75
    got = target_probs(logits, params(top_p=0.75))
    torch.testing.assert_close(got, torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9)
    # top-k 2 first: renormalised .571, .429; mass before .571 < 0.5 is false -> only token 0
    got = target_probs(logits, params(top_k=2, top_p=0.5))
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # the most likely token always survives a tiny top_p
    got = target_probs(logits, params(top_p=1e-9))
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_inverse_cdf_draw_follows_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3])
    n = 40000
    counts = torch.zeros(4)
    for i in range(n):
        counts[sample_from_probs(probs, uniform(11, i, Purpose.SAMPLE))] += 1
    assert counts[1] == 0
    for j in (0, 2, 3):
        p = float(probs[j])
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(float(counts[j]) / n - p) < 5 * sigma


def test_draw_edges():
    probs = torch.tensor([0.0, 0.25, 0.75, 0.0])
    assert sample_from_probs(probs, 1e-9) == 1
    assert sample_from_probs(probs, 0.25 - 1e-7) == 1
    assert sample_from_probs(probs, 0.25 + 1e-7) == 2
    assert sample_from_probs(probs, 1 - 1e-9) == 2  # never a zero-mass tail token


@pytest.mark.parametrize("field,value,fragment", [
    ("temperature", -0.1, "temperature=-0.1"),
    ("top_p", 0.0, "top_p=0.0"),
    ("top_p", 1.5, "top_p=1.5"),
    ("top_k", -2, "top_k=-2"),
    ("top_k", 0, "top_k=0"),
    ("max_tokens", 0, "max_tokens=0"),
    ("seed", -1, "seed=-1"),
    ("temperature", float("nan"), "temperature=nan"),
])
def test_invalid_parameters_are_refused_by_name(field, value, fragment):
    with pytest.raises(RequestError, match=fragment.replace(".", r"\.")):
        SamplingParams(**{field: value})
