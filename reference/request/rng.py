"""Randomness as an input: a counter-based generator keyed by (seed, position, purpose, slot).

Every random number the system draws is a pure function of four integers, never of a hidden
generator state, so the fp32 reference and the fast engine (a Triton kernel can compute the
same bits) sample the same tokens, whatever the batch composition or step order.

Generator: Philox-4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC'11), the generator cuRAND and Triton use:

    key     = (seed mod 2^32, seed >> 32 mod 2^32)
    counter = (position, purpose, slot, 0)                 four uint32 words
    round   : (c0, c1, c2, c3) <- (hi(B*c2) ^ c1 ^ k0, lo(B*c2), hi(A*c0) ^ c3 ^ k1, lo(A*c0))
              (k0, k1) <- (k0 + 0x9E3779B9, k1 + 0xBB67AE85)       all mod 2^32
    with A = 0xD2511F53, B = 0xCD9E8D57; the output is c0 after 10 rounds.

Uniform: u = ((c0 >> 9) + 0.5) * 2^-23 = (2m + 1) * 2^-24 with m < 2^23, so the numerator
fits fp32's 24-bit significand: u is exact in fp32 (and fp64) and lies in the open interval
(0, 1); neither 0 nor 1 can be drawn.

Keys used by the system (s is a verify step's anchor position, i = 1..k a draft slot):

    what                                          position   purpose    slot
    a token sampled by plain decoding / prefill   its own    SAMPLE     0
    the selector's pick at slot i                 s          SELECTOR   i
    the acceptance test of slot i                 s          ACCEPT     i
    the resample after a rejection                s          RESIDUAL   0
    the bonus token after k acceptances           s          BONUS      0

A request's anchors strictly increase, so no key is used twice within a request.
"""

from __future__ import annotations

from enum import IntEnum

import torch

PHILOX_A = 0xD2511F53
PHILOX_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF


class Purpose(IntEnum):
    SAMPLE = 0
    SELECTOR = 1
    ACCEPT = 2
    RESIDUAL = 3
    BONUS = 4


def philox4x32(seed: int, c0: int, c1: int, c2: int, c3: int = 0) -> tuple[int, int, int, int]:
    """Philox-4x32-10 on Python integers: the readable definition."""
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(PHILOX_ROUNDS):
        prod_b, prod_a = PHILOX_B * c2, PHILOX_A * c0
        c0, c1, c2, c3 = ((prod_b >> 32) ^ c1 ^ k0) & MASK32, prod_b & MASK32, \
                         ((prod_a >> 32) ^ c3 ^ k1) & MASK32, prod_a & MASK32
        k0, k1 = (k0 + PHILOX_KEY_A) & MASK32, (k1 + PHILOX_KEY_B) & MASK32
    return c0, c1, c2, c3


def check_seed(seed: int) -> int:
    if not (isinstance(seed, int) and 0 <= seed < 2**64):
        raise ValueError(f"seed={seed!r}: expected an integer in [0, 2^64)")
    return seed


def uniform(seed: int, position: int, purpose: Purpose, slot: int = 0) -> float:
    """One uniform in (0, 1) keyed by (seed, position, purpose, slot)."""
    for name, value in (("position", position), ("slot", slot)):
        if not 0 <= value <= MASK32:
            raise ValueError(f"{name}={value}: expected an integer in [0, 2^32)")
    word = philox4x32(check_seed(seed), position, int(purpose), slot)[0]
    return ((word >> 9) + 0.5) * 2.0**-23


def uniforms(seed: int, position: int, purpose: Purpose, num_slots: int) -> torch.Tensor:
    """Slots 0..num_slots-1 at one (seed, position, purpose), as an fp32 tensor  # [num_slots]."""
    return torch.tensor([uniform(seed, position, purpose, s) for s in range(num_slots)], dtype=torch.float32)


def derive_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th independent sample of one prompt (``--n``).

    Two Philox words of (seed, index) under a purpose no draw uses, so derived seeds are
    unrelated to the draws of the parent seed.
    """
    words = philox4x32(check_seed(seed), index & MASK32, 0xFFFF_FFFF, index >> 32)
    return words[0] | (words[1] << 32)
