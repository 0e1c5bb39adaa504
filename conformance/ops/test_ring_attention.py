"""fast/kernels/ring_attention.py vs reference/draft.window_attention: B blocks over their ring windows
(NUMERIC), at small windows (W = 13 and 37, capacity W + 4), odd shapes, GQA, with every ring slot
outside the window poisoned with NaN."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.ring_attention import ring_attention_torch, ring_attention_triton
from dflash2.reference.model.draft import window_attention

MARGIN = 4


@dataclass
class Case:
    q: torch.Tensor  # [B*S, H, D]
    block_k: torch.Tensor  # [B*S, Hkv, D]
    block_v: torch.Tensor
    ring_k: torch.Tensor  # [num_slots, CAPACITY, Hkv, D], NaN outside each block's window
    ring_v: torch.Tensor
    ring_slots: torch.Tensor  # [B]
    anchors: torch.Tensor  # [B]
    window: int
    expected: torch.Tensor  # [B*S, H, D] from the reference


def make_case(block: int, heads: int, kv_heads: int, dim: int, anchors: list[int], seed: int,
              window: int = 13) -> Case:
    gen = torch.Generator().manual_seed(seed)
    batch = len(anchors)
    num_slots = batch + 2
    ring_slots = torch.randperm(num_slots, generator=gen)[:batch]
    q = torch.randn(batch * block, heads, dim, generator=gen)
    block_k, block_v = (torch.randn(batch * block, kv_heads, dim, generator=gen) for _ in range(2))
    capacity = window + MARGIN
    ring_k = torch.full((num_slots, capacity, kv_heads, dim), float("nan"))
    ring_v = ring_k.clone()
    expected = []
    for b, s in enumerate(anchors):
        ctx_positions = torch.arange(max(0, s - window + 1), s)
        ctx_k, ctx_v = (torch.randn(len(ctx_positions), kv_heads, dim, generator=gen) for _ in range(2))
        ring_k[ring_slots[b], ctx_positions % capacity] = ctx_k
        ring_v[ring_slots[b], ctx_positions % capacity] = ctx_v
        rows = slice(b * block, (b + 1) * block)
        expected.append(window_attention(q[rows], s + torch.arange(block), block_k[rows], block_v[rows], ctx_k, ctx_v,
                                         ctx_positions, window))
    return Case(q, block_k, block_v, ring_k, ring_v, ring_slots, torch.tensor(anchors), window, torch.cat(expected))


def check_ring_attention(fn, case: Case, device: str, dtype: torch.dtype, report, **kwargs) -> None:
    to = dict(device=device, dtype=dtype)
    got = fn(case.q.to(**to), case.block_k.to(**to), case.block_v.to(**to), case.ring_k.to(**to),
             case.ring_v.to(**to), case.ring_slots.to(device), case.anchors.to(device), case.window, **kwargs)
    assert got.dtype == dtype and got.shape == case.expected.shape
    report.numeric(f"attention/{str(dtype)[6:]}", got.float(), case.expected, NUMERIC_BOUND[dtype])


SHAPES = [  # S, H, Hkv, D, W, anchors (0, short contexts, exactly W-1 rows, wrapped rings)
    (5, 6, 2, 12, 13, [0, 3, 12, 13, 40, 101]),
    (8, 4, 4, 16, 13, [1, 29]),
    (3, 5, 1, 7, 13, [7, 12, 250]),
    (7, 4, 2, 9, 37, [0, 5, 20, 36, 37, 200]),  # several 16-key chunks, leading ones before position 0
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"S{s[0]}-H{s[1]}-Hkv{s[2]}-D{s[3]}-W{s[4]}")
def test_ring_attention_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    block, heads, kv_heads, dim, window, anchors = shape
    case = make_case(block, heads, kv_heads, dim, anchors, seed=block * 100 + dim, window=window)
    fn = pick(impl, ring_attention_torch, ring_attention_triton)
    kwargs = {"block_n": 16} if impl == "triton" else {}
    for dtype in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        check_ring_attention(fn, case, device, dtype, report, **kwargs)


def test_planted_bug_off_by_one_ring_slot_is_caught(impl_device, report):
    impl, device = impl_device
    case = make_case(5, 6, 2, 12, [3, 40, 101], seed=1)
    case.ring_k, case.ring_v = case.ring_k.roll(1, dims=1), case.ring_v.roll(1, dims=1)  # reads slot p-1 mod C
    with pytest.raises(AssertionError):
        check_ring_attention(pick(impl, ring_attention_torch, ring_attention_triton), case, device, torch.float32,
                             report)


def test_planted_bug_wrong_scale_is_caught(impl_device, report):
    impl, device = impl_device
    case = make_case(5, 6, 2, 12, [3, 40, 101], seed=2)
    with pytest.raises(AssertionError, match="rms-relative"):
        check_ring_attention(pick(impl, ring_attention_torch, ring_attention_triton), case, device, torch.float32,
                             report, scale=13 ** -0.5)
