"""Keyed uniforms on the device: Philox-4x32-10 of (seed, position, purpose, slot), twin of ``reference/request/rng.py``.

    key     = (seed mod 2^32, seed >> 32)
    counter = (position, purpose, slot, 0)
    u       = ((c0 >> 9) + 0.5) * 2^-23            bit-identical to ``rng.uniform`` (EXACT)

Seeds are uint64 carried in int64 tensors as their bit pattern (``seeds_tensor``).

Two implementations of one function:
- ``philox_uniform`` / ``philox4x32_10``: Triton device functions that the sampler, the verifier
  and the selector call inside their kernels; ``keyed_uniform_triton`` launches them on vectors.
- ``keyed_uniform_torch``: the same words in int64 torch arithmetic (32x32 -> 64-bit products
  split into 16-bit halves, since int64 cannot hold them), for CPU and as a cross-check. A CPU call
  with at most ``SMALL_BATCH`` keys (every call of a decode or verify step at a few requests) takes
  the shared scalar Philox of ``reference/request/rng.py`` over Python ints instead: the tensor form
  is about 150 tensor operations whatever the size, whose dispatch costs far more for a handful of keys
  than the scalar loop's microseconds per key. Both give the same words (conformance/ops/test_philox.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from dflash2.reference.request.rng import (MASK32, PHILOX_A, PHILOX_B, PHILOX_KEY_A, PHILOX_KEY_B, PHILOX_ROUNDS,
                                            philox4x32)

from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

_ROUND_A = tl.constexpr(PHILOX_A)
_ROUND_B = tl.constexpr(PHILOX_B)
_KEY_A = tl.constexpr(PHILOX_KEY_A)
_KEY_B = tl.constexpr(PHILOX_KEY_B)
_ROUNDS = tl.constexpr(PHILOX_ROUNDS)
_TWO_POW_M23 = tl.constexpr(2.0**-23)


def seed_bits(seeds: Iterable[int]) -> list[int]:
    """uint64 seeds as the int64 values of their bit patterns."""
    return [s - 2**64 if s >= 2**63 else s for s in seeds]


def seeds_tensor(seeds: Iterable[int], device: torch.device | str = "cpu") -> Tensor:
    """uint64 seeds as int64 bit patterns  # [B]."""
    return torch.tensor(seed_bits(seeds), dtype=torch.int64, device=device)


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on uint32 tensors; returns the four output words."""
    for _ in tl.static_range(_ROUNDS):
        hi_b = tl.umulhi(c2, _ROUND_B)
        lo_b = c2 * _ROUND_B
        hi_a = tl.umulhi(c0, _ROUND_A)
        lo_a = c0 * _ROUND_A
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = k0 + _KEY_A
        k1 = k1 + _KEY_B
    return c0, c1, c2, c3


@triton.jit
def philox_uniform(seed, position, purpose, slot):
    """u(seed, position, purpose, slot) in fp32. seed: int64 (uint64 bits); the others: integers < 2^32."""
    seed = seed.to(tl.uint64, bitcast=True)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c0 = position.to(tl.uint32)
    c1 = (tl.zeros_like(position) + purpose).to(tl.uint32)
    c2 = (tl.zeros_like(position) + slot).to(tl.uint32)
    c3 = c0 * 0
    word, _, _, _ = philox4x32_10(c0, c1, c2, c3, k0, k1)
    return ((word >> 9).to(tl.float32) + 0.5) * _TWO_POW_M23


@triton.jit
def _keyed_uniform_kernel(seed_ptr, position_ptr, purpose_ptr, slot_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    position = tl.load(position_ptr + offs, mask=mask, other=0)
    purpose = tl.load(purpose_ptr + offs, mask=mask, other=0)
    slot = tl.load(slot_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, philox_uniform(seed, position, purpose, slot), mask=mask)


def _broadcast_keys(seeds: Tensor, positions: Tensor | int, purpose: Tensor | int, slots: Tensor | int):
    device = seeds.device
    keys = [torch.as_tensor(x, dtype=torch.int64, device=device) for x in (seeds, positions, purpose, slots)]
    return torch.broadcast_tensors(*keys)


def keyed_uniform_triton(seeds: Tensor, positions: Tensor | int, purpose: Tensor | int,
                         slots: Tensor | int = 0) -> Tensor:
    """Uniforms of broadcast keys, fp32, by the Triton kernel  # any shape -> that shape."""
    keys = _broadcast_keys(seeds, positions, purpose, slots)
    shape = keys[0].shape
    flat = [k.reshape(-1).contiguous() for k in keys]
    out = torch.empty(flat[0].numel(), dtype=torch.float32, device=seeds.device)
    n, block = out.numel(), 256
    if n:
        _keyed_uniform_kernel[(triton.cdiv(n, block),)](*flat, out, n, BLOCK=block)
    return out.reshape(shape)


# -- torch ----------------------------------------------------------------------------------------

def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of a * m for int64 a in [0, 2^32) and a 32-bit constant m."""
    p_lo, p_hi = (a & 0xFFFF) * m, (a >> 16) * m  # each < 2^48
    return (p_hi + (p_lo >> 16)) >> 16, (((p_hi & 0xFFFF) << 16) + p_lo) & MASK32


def philox4x32_10_torch(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor):
    """Philox-4x32-10 on int64 tensors holding uint32 values."""
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(c2, PHILOX_B)
        hi_a, lo_a = _mulhilo(c0, PHILOX_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & MASK32, (k1 + PHILOX_KEY_B) & MASK32
    return c0, c1, c2, c3


SMALL_BATCH = 64  # CPU calls with at most this many keys take the scalar loop (module docstring)
MASK64 = (1 << 64) - 1


def keyed_uniform_scalar(seeds: Tensor, positions: Tensor, purpose: Tensor, slots: Tensor) -> Tensor:
    """``keyed_uniform_torch`` of broadcast CPU keys by the shared scalar Philox  # any shape -> that shape."""
    columns = [t.reshape(-1).tolist() for t in (seeds, positions, purpose, slots)]
    out = [((philox4x32(seed & MASK64, position & MASK32, use & MASK32, slot & MASK32)[0] >> 9) + 0.5) * 2.0**-23
           for seed, position, use, slot in zip(*columns)]
    return torch.tensor(out, dtype=torch.float32).reshape(seeds.shape)


def keyed_uniform_torch(seeds: Tensor, positions: Tensor | int, purpose: Tensor | int,
                        slots: Tensor | int = 0, *, small_batch: int = SMALL_BATCH) -> Tensor:
    """Uniforms of broadcast keys, fp32, in torch integer arithmetic  # any shape -> that shape."""
    seeds, positions, purpose, slots = _broadcast_keys(seeds, positions, purpose, slots)
    if seeds.device.type == "cpu" and seeds.numel() <= small_batch:
        return keyed_uniform_scalar(seeds, positions, purpose, slots)
    k0, k1 = seeds & MASK32, (seeds >> 32) & MASK32
    word = philox4x32_10_torch(positions & MASK32, purpose & MASK32, slots & MASK32, torch.zeros_like(seeds),
                               k0, k1)[0]
    return ((word >> 9).to(torch.float32) + 0.5) * 2.0**-23


keyed_uniform = KernelOp("philox", keyed_uniform_torch, GpuForm(keyed_uniform_triton))
