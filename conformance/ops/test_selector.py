"""fast/kernels/selector.py vs reference/selector.select: candidates and walked tokens EXACT (away from
near-ties on the reference's path), q and the edge scores NUMERIC, greedy and sampled requests in
one batch, k = 1..S-1, ties among the logits, odd V, K_sel, r and C."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.philox import seeds_tensor
from dflash2.fast.kernels import selector as selector_module
from dflash2.fast.kernels.selector import select_torch, select_triton
from dflash2.reference.model.draft import DraftBlockOutput
from dflash2.reference.speculative.selector import CandidateSelector, select, selector_uniforms

NEAR_TIE = 1e-4  # fp32 near-tie logit gap (docs/tolerances.md), for sigma; relative for the draw's CDF


@dataclass
class Case:
    logits: torch.Tensor  # [B, S-1, V]
    hidden: torch.Tensor  # [B, S, C]
    selector: CandidateSelector
    anchor_tokens: torch.Tensor  # [B]
    temperature: torch.Tensor  # [B], 0: greedy
    seeds: list[int]
    anchor_positions: torch.Tensor  # [B]


def make_case(batch: int, block: int, vocab: int, hidden_size: int, rank: int, top_k: int, seed: int) -> Case:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, block - 1, vocab, generator=gen) * 2
    logits[0, 0, 3] = logits[0, 0, 11] = logits[0, 0].max() + 1  # a tie for the top candidate
    logits[1 % batch, :, :top_k + 2] = 4.0  # equal logits straddling the top-K cut
    selector = CandidateSelector(torch.randn(rank, hidden_size, generator=gen) / hidden_size ** 0.5,
                                 torch.randn(vocab, rank, generator=gen) * 0.6,
                                 torch.randn(vocab, rank, generator=gen) * 0.6, top_k)
    return Case(logits, torch.randn(batch, block, hidden_size, generator=gen), selector,
                torch.randint(0, vocab, (batch,), generator=gen),
                torch.tensor([rng.choice([0.0, 0.5, 1.0, 1.8]) for _ in range(batch)]),
                [rng.getrandbits(64) for _ in range(batch)],
                torch.tensor([rng.choice([0, rng.randrange(5000), 2**32 - 8]) for _ in range(batch)]))


def reference_walk(case: Case, b: int, k: int):
    """The reference's walk and the smallest margin of a decision on its path."""
    temperature = float(case.temperature[b])
    uniforms = None if temperature == 0 else selector_uniforms(case.seeds[b], int(case.anchor_positions[b]), k)
    out = select(DraftBlockOutput(case.hidden[b], case.logits[b]), case.selector, int(case.anchor_tokens[b]), k,
                 temperature, uniforms)
    margin = float("inf")
    for i in range(k):
        if uniforms is None:
            top2 = torch.topk(out.sigma[i], 2).values
            margin = min(margin, float(top2[0] - top2[1]))
        else:
            cdf = torch.cumsum(out.draft_probs[i].double(), dim=0)
            margin = min(margin, float((cdf - float(uniforms[i]) * cdf[-1]).abs().min() / cdf[-1]))
    return out, margin


def run(fn, case: Case, k: int, device: str, **kwargs):
    s = case.selector
    return fn(case.logits.to(device), case.hidden.to(device), s.hidden_projection.to(device),
              s.predecessor_codebook.to(device), s.successor_codebook.to(device), case.anchor_tokens.to(device), k,
              s.top_k, case.temperature.to(device), (case.temperature == 0).to(device),
              seeds_tensor(case.seeds, device), case.anchor_positions.to(device), **kwargs)


CONFIGS = [  # B, S, V, C, r, K_sel, k
    (6, 4, 53, 10, 7, 5, 3),
    (3, 8, 97, 12, 9, 16, 7),
    (4, 3, 41, 6, 5, 3, 1),
]


@pytest.mark.parametrize("merge_blocks", [16, 1], ids=["one-merge", "two-level-merge"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"B{c[0]}-S{c[1]}-V{c[2]}-K{c[5]}-k{c[6]}")
def test_select_matches_reference(impl_device, report, config, merge_blocks, monkeypatch):
    impl, device = impl_device
    if merge_blocks != selector_module.MERGE_BLOCKS and impl != "triton":
        pytest.skip("the merge levels are the Triton form's")
    monkeypatch.setattr(selector_module, "MERGE_BLOCKS", merge_blocks)  # 1: every case (2-4 blocks) merges in two levels
    batch, block, vocab, hidden_size, rank, top_k, k = config
    case = make_case(batch, block, vocab, hidden_size, rank, top_k, seed=vocab)
    kwargs = {"block_v": 32} if impl == "triton" else {}  # several vocabulary blocks to merge
    got = run(pick(impl, select_torch, select_triton), case, k, device, **kwargs)
    probs, sigma, ref_probs, ref_sigma = [], [], [], []
    for b in range(batch):
        ref, margin = reference_walk(case, b, k)
        assert torch.equal(got.cand_ids[b, 0].cpu(), ref.cand_ids[0]), f"request {b}: slot 1 candidates"
        if margin < NEAR_TIE:
            continue
        assert got.tokens[b].tolist() == ref.tokens.tolist(), f"request {b}: tokens"
        assert torch.equal(got.cand_ids[b].cpu(), ref.cand_ids), f"request {b}: candidates"
        probs.append(got.draft_probs[b])
        sigma.append(got.sigma[b])
        ref_probs.append(ref.draft_probs)
        ref_sigma.append(ref.sigma)
    assert len(probs) >= batch - 1
    report.numeric("draft_probs", torch.stack(probs), torch.stack(ref_probs), NUMERIC_BOUND[torch.float32])
    report.numeric("sigma", torch.stack(sigma), torch.stack(ref_sigma), NUMERIC_BOUND[torch.float32])


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: f"B{c[0]}-S{c[1]}-V{c[2]}-K{c[5]}-k{c[6]}")
def test_select_reads_model_dtype_logits_exactly(impl_device, config):
    """The draft's logits arrive in the model dtype (``DraftBlocks.logits``, no fp32 copy of the rows): bf16
    logits give bit for bit the result of their exact fp32 conversion (tokens, candidates, q, sigma)."""
    impl, device = impl_device
    batch, block, vocab, hidden_size, rank, top_k, k = config
    case = make_case(batch, block, vocab, hidden_size, rank, top_k, seed=vocab + 1)
    case.logits = case.logits.bfloat16()  # ties among the bf16 values too, more than in fp32
    kwargs = {"block_v": 32} if impl == "triton" else {}
    fn = pick(impl, select_torch, select_triton)
    got = run(fn, case, k, device, **kwargs)
    case.logits = case.logits.float()
    expected = run(fn, case, k, device, **kwargs)
    for name in ("tokens", "cand_ids", "draft_probs", "sigma"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
