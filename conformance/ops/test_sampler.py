"""fast/kernels/sampling/sampler.py and row_filter.py vs reference/speculative/sampling.py: filtered target probabilities
(NUMERIC, support EXACT), keyed inverse-CDF draws (EXACT), and the sort-free cut finder against its torch twin
(kept set EXACT, kept mass within 1e-12).

Decisions the reference takes in fp32 and the fast code in fp64 are skipped at their near ties (1e-5 relative,
docs/tolerances.md) and counted: a draw's CDF step, and the top-p rule's mass before a token of the top-k
prefix. The cut finder is held to its twin with no skipping, over launch shapes small enough that the
bisection rounds, buffer overflows and the per-row finisher all run at these vocabulary sizes.
"""

from __future__ import annotations

import random

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.sampling import row_filter
from dflash2.fast.kernels.sampling.row_filter import (FilterConfig, Layout, filter_torch, filter_triton, kept_by_cut,
                                             kept_weights_torch, scaled_logits)
from dflash2.fast.kernels.sampling.sampler import (HostSummary, SamplingTensors, sample_torch, sample_triton,
                                          target_probs_torch, target_probs_triton)
from dflash2.reference.request.rng import Purpose, uniform
from dflash2.reference.request.sampling_params import TOP_K_OFF, SamplingParams
from dflash2.reference.speculative.sampling import most_likely_order, sample_from_probs, target_probs

CDF_TIE = 1e-5  # a draw whose target lies this close (relative) to a CDF step may round either way
TOP_P_TIE = 1e-5  # a top-p decision whose mass before lies this close (relative) to top_p may go either way

# launch shapes that send rows of a few dozen tokens through every path of the cut finder
CONFIGS = {
    "default": FilterConfig(),
    "bisect": FilterConfig(block_v=16, blocks_per_chunk=2, cap=8, thresholds=4, block_r=8, rounds=3, min_chunks=1),
    "finisher_only": FilterConfig(block_v=16, blocks_per_chunk=1, cap=4, thresholds=8, block_r=4, rounds=0,
                                  min_chunks=1),
}


def random_params(n: int, rng: random.Random) -> list[SamplingParams]:
    fixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=1),
             SamplingParams(temperature=1.0), SamplingParams(temperature=0.05, top_p=0.9),
             SamplingParams(temperature=1.0, top_k=1000), SamplingParams(temperature=1.0, top_p=1e-6),
             SamplingParams(temperature=3.0, top_k=3, top_p=0.5, seed=2**64 - 1)]
    out = fixed[:n]
    while len(out) < n:
        out.append(SamplingParams(temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.7]),
                                  top_k=rng.choice([-1, -1, 1, 2, 5, 20]),
                                  top_p=rng.choice([1.0, 1.0, 0.95, 0.7, 0.3]),
                                  seed=rng.getrandbits(64)))
    return out


def random_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[1::5, 2] = logits[1::5, 7] = logits[1::5].max(dim=-1).values + 0.5  # tied maxima
    logits[2::5, vocab // 2:] = float("-inf")  # a masked half of the vocabulary
    logits[3::5, :6] = logits[3::5, 0:1]  # a run of equal logits
    return logits


def stress_rows(vocab: int = 40) -> list[tuple[str, torch.Tensor, SamplingParams]]:
    """Named rows at the edges of the filter's rules (one batch: greedy and sampled rows mixed)."""
    gen = torch.Generator().manual_seed(11)
    distinct = torch.randperm(vocab, generator=gen).float() * 0.25  # distinct logits, no ties
    rows = []

    def add(name, logits, **params):
        rows.append((name, logits, SamplingParams(**params)))

    tied = distinct.clone()
    tied[[0, 17, 25]] = torch.tensor([100.0, 99.0, 98.0])
    tied[[5, 11, 2, 30]] = 50.0  # ranks 4..7 tie, every other logit is below 10
    add("tie at the k-th logit", tied, top_k=5)
    add("tie at the k-th logit, top-p after", tied, top_k=6, top_p=0.999)
    add("top_k > V", distinct, top_k=1000)
    add("top_k = V", distinct, top_k=vocab)
    add("top_k = V - 1", distinct, top_k=vocab - 1)
    add("top_p = 1, top_k off", distinct * 0.3, temperature=0.7)
    maxima = distinct.clone()
    maxima[[7, 3]] = distinct.max() + 1
    add("tiny top_p, tied maxima", maxima, top_p=1e-6)
    add("greedy, tied maxima", maxima, temperature=0.0)
    add("all equal, top-k 5", torch.zeros(vocab), top_k=5)
    add("all equal, top-p 0.3 (an exact tie: reference skipped)", torch.zeros(vocab), top_p=0.3)
    masked = distinct.clone()
    masked[10:] = float("-inf")
    add("-inf logits, top_k above the finite count", masked, top_k=15)
    add("-inf logits, top-p", masked, top_p=0.9)
    group = torch.full((vocab,), -3.0) - distinct * 0.01
    group[4] = 2.0
    group[[1, 8, 20, 33]] = 1.0
    probs = torch.softmax(group.double(), dim=0)
    top_p = float(probs[4] + 1.5 * probs[1])  # between the mass before the group's 2nd and 3rd members
    add("top-p cuts inside a tie group", group, top_p=top_p)
    add("top-k then top-p", distinct, top_k=10, top_p=0.5)
    ranked = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15] + [0.1 / (vocab - 4)] * (vocab - 4)))
    add("top-p over the top-k mass, not the whole", ranked, top_k=3, top_p=0.6)  # keeps 2 (3 if top-p came first)
    add("top-k off, top-p < 1, flat", torch.randn(vocab, generator=gen) * 0.3, top_p=0.95)
    zeros = distinct - distinct.max() - 1
    zeros[0] = 1.0
    zeros[3], zeros[5] = -0.0, 0.0  # one value: -0.0 and 0.0 tie, the lower id first
    add("-0.0 and 0.0 tie at the k-th", zeros, top_k=2)
    add("low temperature, long tail", distinct, temperature=0.05, top_p=0.99)
    return rows


def top_p_margin(logits: torch.Tensor, params: SamplingParams) -> float:
    """How close the reference's mass before a token of its top-k prefix comes to top_p (relative; 1 without
    top-p). Above TOP_P_TIE the reference (fp32) and the fast filter (fp64) keep the same tokens."""
    if params.greedy or params.top_p >= 1.0:
        return 1.0
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    ranked = probs[most_likely_order(probs)]
    if params.top_k != TOP_K_OFF:
        ranked = ranked[:params.top_k]
    ranked = ranked / ranked.sum()
    before = torch.cumsum(ranked, dim=0) - ranked
    return float((before - params.top_p).abs().min()) / params.top_p


def cdf_margin(probs: torch.Tensor, u: float) -> float:
    cdf = torch.cumsum(probs.double(), dim=0)
    return float((cdf - u * cdf[-1]).abs().min() / cdf[-1])


def check_target_probs(fn, logits: torch.Tensor, params: list[SamplingParams], device: str, report=None) -> int:
    """Support EXACT and values NUMERIC against the reference on rows away from top-p near ties; returns the
    number of rows skipped."""
    got = fn(logits.to(device), SamplingTensors.from_params(params, device)).cpu()
    expected = torch.stack([target_probs(logits[b], params[b]) for b in range(len(params))])
    keep = [b for b in range(len(params)) if top_p_margin(logits[b], params[b]) >= TOP_P_TIE]
    for b in keep:
        assert torch.equal(got[b] > 0, expected[b] > 0), f"row {b} ({params[b]}): the kept support differs"
    if report is not None:
        report.numeric("target_probs", got[keep], expected[keep], NUMERIC_BOUND[torch.float32])
    return len(params) - len(keep)


@pytest.mark.parametrize("rows,vocab", [(9, 37), (24, 101)])
def test_target_probs(impl_device, report, rows, vocab):
    impl, device = impl_device
    params = random_params(rows, random.Random(vocab))
    logits = random_logits(rows, vocab, torch.Generator().manual_seed(rows))
    skipped = check_target_probs(pick(impl, target_probs_torch, target_probs_triton), logits, params, device, report)
    assert skipped <= 2


def test_stress_rows_target_probs(impl_device, report):
    impl, device = impl_device
    names, logits, params = zip(*stress_rows())
    skipped = check_target_probs(pick(impl, target_probs_torch, target_probs_triton), torch.stack(logits),
                                 list(params), device, report)
    assert skipped == 1  # the designed exact tie (all equal logits, top-p 0.3)


def check_filter(logits: torch.Tensor, st: SamplingTensors, flt, rows_per_request: int = 1) -> None:
    """The cut finder's result against its torch twin: the same kept set (EXACT), kept mass within 1e-12,
    argmax EXACT (sampled rows; greedy rows need only the argmax)."""
    twin = filter_torch(logits, st, rows_per_request)
    x, greedy = scaled_logits(logits, st, rows_per_request)
    fast_kept = kept_by_cut(x, flt.cut_x.cpu(), flt.cut_id.cpu())
    twin_kept = kept_by_cut(x, twin.cut_x, twin.cut_id)
    assert torch.equal(flt.argmax.cpu(), twin.argmax), "argmax differs"
    for r in torch.nonzero(~greedy).flatten().tolist():
        ids = [kept.nonzero().flatten().tolist() for kept in (fast_kept[r], twin_kept[r])]
        assert torch.equal(fast_kept[r], twin_kept[r]), f"row {r}: kept {ids[0]}, twin {ids[1]}"
        z_fast, z_twin = float(flt.z_kept[r]), float(twin.z_kept[r])
        assert abs(z_fast - z_twin) <= 1e-12 * z_twin, f"row {r}: kept mass {z_fast} vs {z_twin}"


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_filter_matches_twin(impl_device, config):
    impl, device = impl_device
    if impl == "torch":
        pytest.skip("the cut finder has no torch form of its own: filter_torch is the twin it is held to")
    names, stress_logits, stress_params = zip(*stress_rows())
    rng = random.Random(5)
    params = list(stress_params) + random_params(10, rng)
    logits = torch.cat([torch.stack(stress_logits), random_logits(10, 40, torch.Generator().manual_seed(2))])
    st = SamplingTensors.from_params(params, device)
    flt = filter_triton(logits.to(device), st, config=CONFIGS[config])
    check_filter(logits, SamplingTensors.from_params(params), flt)


def test_filter_without_host_summary_and_across_request_rows(impl_device):
    """Unknown parameters (no host summary: every launch runs) and rows shared by requests give the same cuts."""
    impl, device = impl_device
    if impl == "torch":
        pytest.skip("the cut finder has no torch form of its own")
    params = random_params(6, random.Random(9))
    logits = random_logits(18, 53, torch.Generator().manual_seed(4))
    st = SamplingTensors.from_params(params, device)
    unknown = SamplingTensors(st.temperature, st.top_k, st.top_p, st.seeds)
    flt = filter_triton(logits.to(device), unknown, rows_per_request=3, config=CONFIGS["bisect"])
    check_filter(logits, SamplingTensors.from_params(params), flt, rows_per_request=3)


def test_planted_bug_a_wrong_cut_is_caught():
    params = [p for _, _, p in stress_rows()]
    logits = torch.stack([row for _, row, _ in stress_rows()])
    st = SamplingTensors.from_params(params)
    flt = filter_torch(logits, st)
    r = next(i for i, p in enumerate(params) if p.top_k == 5)  # the tie at the k-th logit
    wrong = row_filter.RowFilter(flt.row_max, flt.argmax, flt.cut_x, flt.cut_id.clone(), flt.z_kept)
    assert int(flt.cut_id[r]) == 5  # the tie group is ids 2, 5, 11, 30: top-k 5 keeps 2 and 5
    wrong.cut_id[r] = 11  # one member too many
    with pytest.raises(AssertionError, match=f"row {r}"):
        check_filter(logits, st, wrong)


def _ties_to_highest_id(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    _, w = kept_weights_torch(logits.flip(-1), st)
    return (w / w.sum(dim=-1, keepdim=True)).float().flip(-1)


def _top_p_before_top_k(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    off = SamplingTensors(st.temperature, torch.full_like(st.top_k, TOP_K_OFF), st.top_p, st.seeds)
    kept_p, w = kept_weights_torch(logits, off)
    no_p = SamplingTensors(st.temperature, st.top_k, torch.ones_like(st.top_p), st.seeds)
    kept_k, _ = kept_weights_torch(logits, no_p)
    w = torch.where(kept_p & kept_k, w, 0.0)
    return (w / w.sum(dim=-1, keepdim=True)).float()


@pytest.mark.parametrize("planted", [_ties_to_highest_id, _top_p_before_top_k], ids=lambda f: f.__name__[1:])
def test_planted_filter_bugs_break_the_stress_rows(planted):
    names, logits, params = zip(*stress_rows())
    with pytest.raises(AssertionError, match="kept support differs"):
        check_target_probs(planted, torch.stack(logits), list(params), "cpu")


def check_sample(fn, logits: torch.Tensor, params: list[SamplingParams], positions: torch.Tensor, device: str) -> int:
    """Tokens EXACT against the reference away from near ties; returns how many rows were checked."""
    got = fn(logits.to(device), SamplingTensors.from_params(params, device), positions.to(device)).cpu()
    checked = 0
    for b in range(len(params)):
        probs = target_probs(logits[b], params[b])
        u = uniform(params[b].seed, int(positions[b]), Purpose.SAMPLE, 0)
        if cdf_margin(probs, u) < CDF_TIE or top_p_margin(logits[b], params[b]) < TOP_P_TIE:
            continue
        checked += 1
        assert int(got[b]) == sample_from_probs(probs, u), f"row {b} ({params[b]})"
    return checked


@pytest.mark.parametrize("rows,vocab", [(40, 37), (64, 257)])
def test_sample(impl_device, rows, vocab):
    impl, device = impl_device
    params = random_params(rows, random.Random(rows + vocab))
    logits = random_logits(rows, vocab, torch.Generator().manual_seed(vocab))
    positions = torch.randint(0, 2**32, (rows,), generator=torch.Generator().manual_seed(1))
    assert check_sample(pick(impl, sample_torch, sample_triton), logits, params, positions, device) >= rows - 2


def test_sample_stress_rows(impl_device):
    impl, device = impl_device
    names, logits, params = zip(*stress_rows())
    params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=31 + i)
              for i, p in enumerate(params)]
    positions = torch.arange(len(params)) * 1009 + 3
    checked = check_sample(pick(impl, sample_torch, sample_triton), torch.stack(logits), params, positions, device)
    assert checked >= len(params) - 2


def test_greedy_batch_is_one_argmax(impl_device, monkeypatch):
    """A batch the host knows is greedy samples by argmax alone (lowest id on ties) and launches no filter."""
    impl, device = impl_device
    logits = random_logits(10, 37, torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, seed=s) if s % 2 else SamplingParams(top_k=1, seed=s) for s in range(10)]
    st = SamplingTensors.from_params(params, device)
    assert st.all_greedy and st.host == HostSummary(False, False, False, TOP_K_OFF)
    from dflash2.fast.kernels.sampling import sampler

    def no_filter(*args, **kwargs):
        raise AssertionError("the greedy path ran the filter")

    monkeypatch.setattr(sampler, "filter_triton", no_filter)
    got = pick(impl, sample_torch, sample_triton)(logits.to(device), st, torch.zeros(10, dtype=torch.long).to(device))
    assert got.cpu().tolist() == [int(torch.argmax(row)) for row in logits]


def test_sample_purpose_and_slot_key_the_draw(impl_device):
    impl, device = impl_device
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    logits = torch.zeros(6, 50)  # uniform over 50 tokens: the token is floor(50 u)
    positions = torch.arange(6) + 100
    fn = pick(impl, sample_torch, sample_triton)
    got = fn(logits.to(device), SamplingTensors.from_params(params, device), positions.to(device),
             Purpose.BONUS, torch.arange(6).to(device)).cpu()
    expected = [sample_from_probs(torch.full((50,), 0.02), uniform(s, 100 + s, Purpose.BONUS, s)) for s in range(6)]
    assert got.tolist() == expected


def test_filter_config_refuses_bad_shapes():
    with pytest.raises(ValueError, match="FilterConfig.cap=12"):
        FilterConfig(cap=12)
    with pytest.raises(ValueError, match="block_r=64"):
        FilterConfig(block_v=32, block_r=64)
    with pytest.raises(ValueError, match="min_chunks >= 1"):
        FilterConfig(min_chunks=0)


@pytest.mark.parametrize("vocab, block_v, blocks_per_chunk", [
    (8256, 256, 1),  # the bundled target: 33 programs per row, not 3 of 4,096 logits
    (248320, 1024, 4),  # the released vocabulary: 61 chunks of 4 blocks already
    (512, 128, 1),  # blocks stop halving at 128 logits
])
def test_a_small_vocabulary_spreads_over_min_chunks_programs(vocab, block_v, blocks_per_chunk):
    layout = Layout.of(vocab, FilterConfig())
    assert (layout.block_v, layout.blocks_per_chunk) == (block_v, blocks_per_chunk)
    assert layout.num_chunks >= min(32, layout.num_blocks)
    assert layout.num_blocks * layout.block_v >= vocab > (layout.num_blocks - 1) * layout.block_v
