"""fast/kernels/sampling/philox.py vs reference/request/rng.py: keyed uniforms bit for bit (EXACT)."""

from __future__ import annotations

import random

import pytest
import torch
from ops_helpers import pick

from dflash2.fast.kernels.sampling import philox
from dflash2.fast.kernels.sampling.philox import keyed_uniform_torch, keyed_uniform_triton, seeds_tensor
from dflash2.reference.request.rng import MASK32, Purpose, uniform

EDGE_SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
EDGE_WORDS = [0, 1, 2**31 - 1, 2**31, MASK32]


def random_keys(n: int, rng: random.Random) -> list[tuple[int, int, int, int]]:
    keys = [(s, p, int(purpose), w) for s in EDGE_SEEDS for p in EDGE_WORDS[::2] for purpose in Purpose
            for w in EDGE_WORDS[1::2]]
    for _ in range(n):
        seed = rng.choice([rng.getrandbits(64), rng.getrandbits(32), rng.choice(EDGE_SEEDS)])
        position = rng.choice([rng.getrandbits(32), rng.randrange(5000), rng.choice(EDGE_WORDS)])
        slot = rng.choice([rng.randrange(8), rng.getrandbits(32), rng.choice(EDGE_WORDS)])
        keys.append((seed, position, rng.randrange(5), slot))
    return keys


def check_uniforms(fn, keys, device: str) -> None:
    seeds, positions, purposes, slots = zip(*keys)
    expected = torch.tensor([uniform(*key) for key in keys], dtype=torch.float32)
    got = fn(seeds_tensor(seeds, device), torch.tensor(positions, device=device),
             torch.tensor(purposes, device=device), torch.tensor(slots, device=device)).cpu()
    mismatches = (got != expected).nonzero()[:, 0].tolist()
    assert not mismatches, f"{len(mismatches)} of {len(keys)} uniforms differ, first key {keys[mismatches[0]]}"


def test_keyed_uniform_is_bit_identical(impl_device):
    impl, device = impl_device
    check_uniforms(pick(impl, keyed_uniform_torch, keyed_uniform_triton), random_keys(2000, random.Random(0)),
                   device)


def test_broadcast_keys(impl_device):
    impl, device = impl_device
    fn = pick(impl, keyed_uniform_torch, keyed_uniform_triton)
    seeds = seeds_tensor([7, 2**64 - 3], device)
    got = fn(seeds[:, None], torch.tensor([11, 12], device=device)[:, None], int(Purpose.ACCEPT),
             torch.arange(1, 6, device=device)[None, :]).cpu()
    expected = torch.tensor([[uniform(s, p, Purpose.ACCEPT, i) for i in range(1, 6)]
                             for s, p in ((7, 11), (2**64 - 3, 12))], dtype=torch.float32)
    assert got.shape == (2, 5) and torch.equal(got, expected)


def test_small_cpu_batches_take_the_scalar_loop_with_the_tensor_forms_words():
    """The CPU's two forms of keyed_uniform_torch agree word for word, and the dispatch is by size."""
    keys = random_keys(300, random.Random(2))
    seeds, positions, purposes, slots = (torch.tensor(c) if i else seeds_tensor(c) for i, c in enumerate(zip(*keys)))
    tensor_form = keyed_uniform_torch(seeds, positions, purposes, slots, small_batch=0)
    scalar_form = philox.keyed_uniform_scalar(seeds, positions, purposes, slots)
    assert torch.equal(tensor_form, scalar_form)
    calls = []
    real = philox.keyed_uniform_scalar
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(philox, "keyed_uniform_scalar", lambda *a: calls.append(a[0].numel()) or real(*a))
        keyed_uniform_torch(seeds[:philox.SMALL_BATCH], 5, 1)
        keyed_uniform_torch(seeds[:philox.SMALL_BATCH + 1], 5, 1)
    assert calls == [philox.SMALL_BATCH]


def test_planted_bug_nine_rounds_is_caught(monkeypatch):
    monkeypatch.setattr(philox, "PHILOX_ROUNDS", 9)
    with pytest.raises(AssertionError, match="uniforms differ"):
        check_uniforms(keyed_uniform_torch, random_keys(50, random.Random(1)), "cpu")
