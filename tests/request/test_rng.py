"""The counter-based generator: a known-answer test, range, independence of keys, and uniformity."""

from __future__ import annotations

import math

import pytest

from dflash2.reference.request.rng import MASK32, Purpose, derive_seed, philox4x32, uniform, uniforms


def test_philox_known_answer():
    # Random123's published known-answer vectors for philox4x32-10 (kat_vectors): counter and key
    # all zero, and all ones.
    assert philox4x32(0, 0, 0, 0, 0) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = (MASK32 << 32) | MASK32
    assert philox4x32(ones, MASK32, MASK32, MASK32, MASK32) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)


def test_uniform_is_a_pure_function_of_its_key():
    assert uniform(7, 100, Purpose.ACCEPT, 3) == uniform(7, 100, Purpose.ACCEPT, 3)
    keys = {(s, p, k, t) for s in (0, 1, 2**40) for p in (0, 1, 5) for k in Purpose for t in (0, 1, 6)}
    values = {uniform(*key) for key in keys}
    assert len(values) == len(keys)  # no two keys collide on this set


def test_uniform_range_and_moments():
    u = uniforms(123, 42, Purpose.SAMPLE, 20000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # mean 1/2 and variance 1/12 within 5 standard errors
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)


def test_uniform_refuses_out_of_range_keys():
    with pytest.raises(ValueError, match="seed"):
        uniform(-1, 0, Purpose.SAMPLE)
    with pytest.raises(ValueError, match="position"):
        uniform(0, 2**32, Purpose.SAMPLE)


def test_derived_seeds_differ():
    seeds = [derive_seed(5, i) for i in range(100)]
    assert len(set(seeds)) == 100 and all(0 <= s < 2**64 for s in seeds)


def test_uniform_is_exact_in_fp32_at_the_extremes():
    import torch

    from dflash2.reference.request import rng

    for word in (0, 2**32 - 1, 2**31, 12345):
        u = ((word >> 9) + 0.5) * 2.0**-23
        assert float(torch.tensor(u, dtype=torch.float32)) == u and 0.0 < u < 1.0
    assert float(rng.uniforms(3, 0, Purpose.ACCEPT, 64).double().max()) < 1.0
