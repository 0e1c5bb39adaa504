"""The CPU shortcuts of the torch twins give the general paths' results EXACTLY.

- ``top_candidates_torch`` (one top-k over unique order keys) == the first K of a stable descending
  sort, ties, -0.0/0.0, infinities and NaN of either sign included;
- an all-greedy batch whose host summary says so (``all_greedy``) takes the draw-free paths of the
  selector walk, the verifier and the sampler: the same tokens, counts, one-hot q, candidates and
  edge scores as the general path (host summary unknown);
- ``ring_attention_torch`` on the CPU gathers only the window positions >= 0 of the batch's latest
  anchor: a short-context block gets the same output (to fp32 rounding) as inside a batch whose
  other block reads the full window.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.kernels.sampling.philox import seeds_tensor
from dflash2.fast.kernels.sampling.rejection import verify_torch
from dflash2.fast.kernels.draft.ring_attention import ring_attention_torch
from dflash2.fast.kernels.sampling.sampler import SamplingTensors, sample_torch
from dflash2.fast.kernels.draft.selector import select_torch, top_candidates_torch
from dflash2.reference.request.sampling_params import SamplingParams


def tied_logits(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Logits on a coarse grid (many exact ties), with both zeros, infinities and NaNs planted."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=gen).float() * 0.5
    flat = x.view(-1, shape[-1])
    flat[0, :4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    flat[-1, 1] = float("nan")
    flat[-1, 5] = -float("nan")
    flat[-1, 2] = -0.0
    return x


@pytest.mark.parametrize("vocab,top_k", [(37, 5), (64, 16), (11, 11), (9, 1)])
def test_top_candidates_equal_stable_sort(vocab, top_k):
    for seed in range(4):
        logits = tied_logits((3, 4, vocab), seed)
        values, ids = top_candidates_torch(logits, top_k)
        ref_values, ref_ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        assert torch.equal(ids, ref_ids[..., :top_k])
        # bitwise, so -0.0 stays -0.0 and NaN stays NaN
        assert torch.equal(values.view(torch.int32), ref_values[..., :top_k].view(torch.int32))


def greedy_st(batch: int, host: bool) -> SamplingTensors:
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0, seed=b) for b in range(batch)])
    return st if host else SamplingTensors(st.temperature, st.top_k, st.top_p, st.seeds)


def test_selector_all_greedy_equals_general():
    batch, block, vocab, hidden, rank, top_k, k = 4, 6, 41, 10, 6, 7, 5
    gen = torch.Generator().manual_seed(3)
    logits = tied_logits((batch, block - 1, vocab), 3)
    logits = torch.nan_to_num(logits, nan=0.25, posinf=9.0, neginf=-9.0)  # the walk's sums need finite logits
    args = (logits, torch.randn(batch, block, hidden, generator=gen), torch.randn(rank, hidden, generator=gen),
            torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen),
            torch.randint(0, vocab, (batch,), generator=gen), k, top_k, torch.zeros(batch),
            torch.ones(batch, dtype=torch.bool), seeds_tensor(range(batch)), torch.tensor([0, 7, 300, 2**32 - 9]))
    for zero_codebook in (False, True):  # zero codebooks: sigma = the unary logits, full of ties
        if zero_codebook:
            args = args[:4] + (torch.zeros(vocab, rank),) + args[5:]
        fast, general = select_torch(*args, all_greedy=True), select_torch(*args)
        for name in ("tokens", "cand_ids", "draft_probs", "sigma"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert torch.equal(fast.draft_probs.sum(dim=-1), torch.ones(batch, k))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_verify_all_greedy_equals_general(k):
    batch, vocab, ksel = 5, 23, 4
    gen = torch.Generator().manual_seed(k)
    logits = tied_logits((batch, k + 1, vocab), k)
    logits = torch.nan_to_num(logits, nan=1.5)
    argmax = torch.argmax(logits, dim=-1)
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, argmax[:, :k],
                         torch.randint(0, vocab, (batch, k), generator=gen))
    cand_ids = torch.cat([drafts[..., None], torch.randint(0, vocab, (batch, k, ksel - 1), generator=gen)], dim=-1)
    probs = torch.zeros(batch, k, ksel)
    probs[..., 0] = 1.0
    anchors = torch.arange(batch) * 17
    fast = verify_torch(logits, greedy_st(batch, True), drafts, cand_ids, probs, anchors)
    general = verify_torch(logits, greedy_st(batch, False), drafts, cand_ids, probs, anchors)
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])


def test_sample_all_greedy_equals_general():
    logits = torch.nan_to_num(tied_logits((9, 31), 5), nan=2.0)
    positions = torch.arange(9)
    fast = sample_torch(logits, greedy_st(9, True), positions)
    assert torch.equal(fast, sample_torch(logits, greedy_st(9, False), positions))
    assert torch.equal(fast, torch.argmax(logits, dim=-1))


def test_ring_attention_reads_only_existing_positions():
    window, block, heads, kv_heads, dim, capacity = 40, 4, 4, 2, 8, 45
    gen = torch.Generator().manual_seed(7)
    ring_k = torch.randn(3, capacity, kv_heads, dim, generator=gen)
    ring_v = torch.randn(3, capacity, kv_heads, dim, generator=gen)
    q = torch.randn(2 * block, heads, dim, generator=gen)
    block_k = torch.randn(2 * block, kv_heads, dim, generator=gen)
    block_v = torch.randn(2 * block, kv_heads, dim, generator=gen)
    for short in (0, 1, 6, window - 2):
        # block 0 (slot 0) alone reads positions 0 .. short-1; next to block 1 (slot 1, anchor past W) the
        # call gathers the whole window for both
        alone = ring_attention_torch(q[:block], block_k[:block], block_v[:block], ring_k, ring_v,
                                     torch.tensor([0]), torch.tensor([short]), window)
        paired = ring_attention_torch(q, block_k, block_v, ring_k, ring_v, torch.tensor([0, 1]),
                                      torch.tensor([short, 3 * window]), window)
        torch.testing.assert_close(alone, paired[:block], rtol=0, atol=1e-6)
