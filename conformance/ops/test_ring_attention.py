"""fast/kernels/draft/ring_attention.py vs reference/draft.window_attention: B blocks over their ring windows
(NUMERIC), at small windows (W = 13 and 37, capacity W + 4), odd shapes, GQA, with every ring slot
outside the window poisoned with NaN.

The split-window path (several programs per (block, KV head), then the merge) against the unsplit
torch twin at fp32 (NUMERIC, 1e-5) and the reference at the low-precision bound, on windows partly
before position 0, exactly W - 1 rows, fully inside and wrapped around the ring, for 1 .. 7 splits of
one or several chunks; it repeats bit for bit. The interpreter's ``tl.dot`` is wrong on bf16
(Triton 3.6), so the low-precision dtype on the CPU is fp16, bf16 on CUDA, as in test_paged_attention.
The H200 plan for the 27B draft's shape is pinned too (a grid from shapes only)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

import dflash2.fast.kernels.attention.paged_attention as paged_attention
from dflash2.fast.kernels.draft.ring_attention import launch_plan, ring_attention_torch, ring_attention_triton
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


SPLIT_ANCHORS = [0, 5, 50, 99, 100, 150, 1000]  # W = 100, capacity 104: partly before 0, W-1 rows, inside, wrapped


@pytest.mark.parametrize("split_len,block_n", [(16, 16), (32, 16), (64, 32), (128, 64)],
                         ids=lambda v: str(v))
def test_split_window_matches_the_unsplit_twin(impl_device, report, split_len, block_n):
    impl, device = impl_device
    if impl != "triton":
        pytest.skip("the split is the Triton launcher's")
    case = make_case(8, 8, 2, 32, SPLIT_ANCHORS, seed=split_len, window=100)  # G = 4: a 32-row tile, as the 27B's
    plan = launch_plan(len(SPLIT_ANCHORS), 8, 2, 8, 32, 100, torch.device(device), split_len=split_len, block_n=block_n)
    assert plan.num_splits == -(-99 // split_len)
    inputs = lambda dtype: [t.to(device=device, dtype=dtype) for t in  # noqa: E731
                            (case.q, case.block_k, case.block_v, case.ring_k, case.ring_v)]
    index = [case.ring_slots.to(device), case.anchors.to(device), case.window]
    unsplit = ring_attention_torch(*inputs(torch.float32), *index)
    got = ring_attention_triton(*inputs(torch.float32), *index, block_n=block_n, split_len=split_len)
    report.numeric("split/float32", got, unsplit, NUMERIC_BOUND[torch.float32])
    again = ring_attention_triton(*inputs(torch.float32), *index, block_n=block_n, split_len=split_len)
    assert torch.equal(got, again), "the split kernel and its merge are not deterministic"
    low = torch.bfloat16 if device == "cuda" else torch.float16
    got = ring_attention_triton(*inputs(low), *index, block_n=block_n, split_len=split_len)
    assert got.dtype == low
    report.numeric(f"split/{str(low)[6:]}", got.float(), case.expected, NUMERIC_BOUND[low])


def test_the_h200_plan_splits_the_27b_window(monkeypatch):
    """132 SMs, W = 2048, Hkv = 8, S * G = 32: 32 splits of 64 keys at B = 1 (256 programs), 2 of 1024 at B = 16."""
    monkeypatch.setattr(paged_attention, "_sm_count", lambda device: 132)
    device = torch.device("cpu")
    plans = {b: launch_plan(b, 32, 8, 8, 128, 2048, device) for b in (1, 2, 4, 8, 16)}
    assert [(p.split_len, p.num_splits) for p in plans.values()] == [(64, 32), (128, 16), (256, 8), (512, 4),
                                                                     (1024, 2)]
    assert all(p.m_pad == 32 and p.d_pad == 128 and p.block_n == 64 for p in plans.values())
