"""fast/kernels/draft/selector.py vs reference/selector.select: candidates and walked tokens EXACT (away from
near-ties on the reference's path), q and the edge scores NUMERIC, greedy and sampled requests in
one batch, k = 1..S-1, ties among the logits, odd V, K_sel, r and C. The candidates alone (C_i, U_i)
bit for bit against the reference's stable sort: ties across vocabulary blocks and merge groups, NaN,
-0.0 and 0.0, infinities, rows shorter than a block, V not a multiple of the block."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.sampling.philox import seeds_tensor
from dflash2.fast.kernels.draft import selector as selector_module
from dflash2.fast.kernels.draft.selector import select_torch, select_triton, top_candidates_torch, top_candidates_triton
from dflash2.reference.model.draft import DraftBlockOutput
from dflash2.reference.speculative.selector import CandidateSelector, select, selector_uniforms, top_candidates

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


NEG_NAN = torch.tensor(-0x400000, dtype=torch.int32).view(torch.float32).item()  # 0xffc00000: a NaN, sign bit set


def _edge_rows(vocab: int, seed: int) -> torch.Tensor:
    """[2, 4, V] logits whose top-K_sel cuts fall in ties and special values, placed across the 32-logit
    blocks (and so across merge groups) that the Triton form is run with."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, vocab, generator=gen)

    def put(b: int, i: int, ids: list[int], values: list[float]) -> None:  # the ids that a short row has
        for j, v in zip(ids, values):
            if j < vocab:
                x[b, i, j] = v

    x[0, 0, 28:60] = 5.0  # 32 equal maxima from the end of block 0 into block 1: the winners are ids 28..
    x[0, 0, 100:120] = 5.0  # more of them in later blocks, which must lose to the lower ids
    x[0, 1] = -float("inf")  # a row of -inf: ids 0, 1, .. in order
    x[0, 1, vocab - 1] = float("inf")
    x[0, 2] = 1.5  # a constant row
    x[0, 3] = -x[0, 3].abs()  # everything <= 0; the zeros on top, either sign, in id order
    zeros = torch.randperm(vocab, generator=gen)[:12]
    x[0, 3, zeros] = torch.where(torch.arange(len(zeros)) % 2 == 0, 0.0, -0.0)
    put(0, 3, [31, 32, 63, 64], [-0.0, 0.0, 0.0, -0.0])  # at block boundaries
    put(0, 3, [5, 70], [1e-45, -1e-45])  # the denormals next to zero keep their own places
    put(1, 0, [3, 31, 32, 33, 95, vocab - 1], [float("nan")] * 6)  # NaN ranks above +inf
    put(1, 0, [4, 50, 6, 51], [float("inf"), float("inf"), NEG_NAN, NEG_NAN])
    x[1, 1] = float("nan")  # a row of NaN: ids in order
    put(1, 1, [11], [float("inf")])
    x[1, 2, :] = -float("inf")
    x[1, 2, vocab // 3:] = float("nan")  # NaN and -inf only
    x[1, 3] = torch.randint(-3, 4, (vocab,), generator=gen).float()  # 7 values: many ties in every block
    return x


@pytest.mark.parametrize("merge_blocks", [16, 2, 1], ids=["one-merge", "merge-pairs", "merge-each"])
@pytest.mark.parametrize("vocab,top_k,block_v", [(200, 16, 32), (161, 5, 32), (97, 16, None), (20, 20, 32),
                                                 (19, 3, None)],
                         ids=lambda v: "default" if v is None else str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_top_candidates_match_stable_sort(impl_device, vocab, top_k, block_v, merge_blocks, dtype, monkeypatch):
    """C_i and U_i exactly the reference's (a stable descending sort): ids, and values bit for bit (the sign
    of -0.0, NaN payloads), with several 32-logit blocks (V not a multiple of 32) or a row shorter than one."""
    impl, device = impl_device
    if merge_blocks != selector_module.MERGE_BLOCKS and impl != "triton":
        pytest.skip("the merge levels are the Triton form's")
    monkeypatch.setattr(selector_module, "MERGE_BLOCKS", merge_blocks)
    logits = _edge_rows(vocab, seed=vocab + top_k).to(dtype)
    kwargs = {"block_v": block_v} if impl == "triton" else {}
    values, ids = pick(impl, top_candidates_torch, top_candidates_triton)(logits.to(device), top_k, **kwargs)
    for b in range(logits.shape[0]):
        for i in range(logits.shape[1]):
            ref_ids, ref_values = top_candidates(logits[b, i], top_k)
            assert ids[b, i].tolist() == ref_ids.tolist(), f"row ({b}, {i}): ids"
            assert values[b, i].cpu().view(torch.int32).tolist() == ref_values.view(torch.int32).tolist(), \
                f"row ({b}, {i}): value bits"


def test_top_candidates_strided_rows(impl_device):
    """The first k rows of [B, S-1, V] logits (a view, as ``select`` passes them) and a non-unit last stride."""
    impl, device = impl_device
    logits = _edge_rows(200, seed=3).to(device)
    fn = pick(impl, top_candidates_torch, top_candidates_triton)
    kwargs = {"block_v": 32} if impl == "triton" else {}
    expected = fn(logits[:, :2].contiguous(), 16, **kwargs)
    for view in (logits[:, :2], logits.transpose(1, 2).contiguous().transpose(1, 2)[:, :2]):
        got = fn(view, 16, **kwargs)
        assert torch.equal(got[1], expected[1])
        assert torch.equal(got[0].view(torch.int32), expected[0].view(torch.int32))


@pytest.mark.parametrize("batch,rows,hidden_size,rank,k", [(1, 8, 2048 // 16, 256 // 16, 7), (3, 5, 40, 9, 4),
                                                           (2, 3, 17, 33, 1)])
def test_project_matches_the_fp32_product(impl_device, report, batch, rows, hidden_size, rank, k):
    """The walk's g = h P^T (``project_triton``): the fp32 product of rows 1..k, from a strided view of h (the
    draft's hidden rows as ``select`` passes them) and a bf16 or fp32 P; rank and C past a tile's edge."""
    impl, device = impl_device
    if impl != "triton":
        pytest.skip("project_triton is the Triton form's (the torch form multiplies in place)")
    gen = torch.Generator().manual_seed(rank * 7 + k)
    wide = torch.randn(batch, rows, 2 * hidden_size, generator=gen)
    hidden = wide[:, :, ::2]  # strides (rows * 2C, 2C, 2)
    for dtype in (torch.float32, torch.bfloat16):
        projection = (torch.randn(rank, hidden_size, generator=gen) / hidden_size ** 0.5).to(dtype)
        h = hidden.to(dtype)
        expected = h[:, 1:k + 1].double() @ projection.double().T
        got = selector_module.project_triton(h.to(device), projection.to(device), k)
        assert got.dtype == torch.float32 and got.shape == (batch, k, rank) and got.is_contiguous()
        report.numeric(f"g/{str(dtype)[6:]}", got, expected, NUMERIC_BOUND[torch.float32])
    with pytest.raises(ValueError, match="expected 1 .. "):
        selector_module.project_triton(hidden.to(device), projection.to(device), rows)
