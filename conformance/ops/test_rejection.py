"""fast/kernels/sampling/rejection.py vs reference/speculative/verify.py: num_accepted and emitted tokens EXACT (away from
acceptance-test, CDF and top-p near ties), over greedy and sampled requests, untrusted q rows (NaN, inf,
negative, zero total, draft outside the candidates), one-hot q, wrong totals, odd V and K, k = 1..7; target rows
at the filter's edges (ties at the k-th logit, top-p inside a tie group, -inf, all equal) under launch shapes that
run the cut finder's bisection and finisher; a batch of greedy requests on its argmax-only path."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import pytest
import torch
from ops_helpers import pick
from test_sampler import CONFIGS, stress_rows, top_p_margin

from dflash2.fast.kernels.sampling import rejection
from dflash2.fast.kernels.sampling.rejection import EMPTY, verify_torch, verify_triton
from dflash2.fast.kernels.sampling.sampler import HostSummary, SamplingTensors
from dflash2.reference.request.rng import Purpose, uniform
from dflash2.reference.speculative.sampling import target_probs
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.verify import draft_row_on_vocab, residual_probs, verify_greedy, verify_sampled_keyed

NEAR_TIE = 1e-5  # acceptance tests, CDF steps and top-p cuts alike (docs/tolerances.md)
BAD_ROWS = ("nan", "inf", "negative", "zero", "outside", "one_hot", "total_x3", "total_half")


@dataclass
class Case:
    params: list[SamplingParams]
    logits: torch.Tensor  # [B, k+1, V]
    drafts: torch.Tensor  # [B, k]
    cand_ids: torch.Tensor  # [B, k, K]
    draft_probs: torch.Tensor  # [B, k, K]
    anchors: torch.Tensor  # [B]


def make_case(batch: int, k: int, ksel: int, vocab: int, seed: int) -> Case:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=rng.choice([0.0, 0.6, 1.0, 1.0, 1.4]), top_k=rng.choice([-1, -1, 1, 4, 9]),
                             top_p=rng.choice([1.0, 1.0, 0.9, 0.6]), seed=rng.getrandbits(64)) for _ in range(batch)]
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    # the draft's view: the target's logits plus noise, so that many drafts are accepted
    noisy = logits[:, :k] + 0.7 * torch.randn(batch, k, vocab, generator=gen)
    cand_ids = torch.sort(noisy, dim=-1, descending=True, stable=True).indices[..., :ksel]
    draft_probs = torch.softmax(noisy.gather(-1, cand_ids), dim=-1)
    picks = torch.multinomial(draft_probs.reshape(-1, ksel), 1, generator=gen).reshape(batch, k)
    drafts = cand_ids.gather(-1, picks[..., None])[..., 0]
    for b, p in enumerate(params):
        if p.greedy:  # a greedy request: its argmax prefix, broken at a random slot
            drafts[b] = logits[b, :k].argmax(dim=-1)
            cut = rng.randrange(k + 1)
            if cut < k:
                drafts[b, cut] = (drafts[b, cut] + 1) % vocab
            continue
        slot = rng.randrange(k)
        kind = BAD_ROWS[b % len(BAD_ROWS)] if b % 3 == 0 else None
        row = draft_probs[b, slot]
        if kind == "nan":
            row[rng.randrange(ksel)] = float("nan")
        elif kind == "inf":
            row[rng.randrange(ksel)] = float("inf")
        elif kind == "negative":
            row[rng.randrange(ksel)] = -0.25
        elif kind == "zero":
            row.zero_()
        elif kind == "outside":
            drafts[b, slot] = next(t for t in range(vocab) if t not in cand_ids[b, slot].tolist())
        elif kind == "one_hot":
            row.zero_()
            row[picks[b, slot]] = 1.0
        elif kind == "total_x3":
            row.mul_(3.0)
        elif kind == "total_half":
            row.mul_(0.5)
    anchors = torch.tensor([rng.choice([0, rng.randrange(10_000), 2**32 - 9]) for _ in range(batch)])
    return Case(params, logits, drafts, cand_ids, draft_probs, anchors)


def reference_result(case: Case, b: int) -> tuple[int, list[int], float]:
    """(num_accepted, emitted, the smallest relative margin of a decision the result depended on)."""
    p = case.params[b]
    if p.greedy:
        r = verify_greedy(case.drafts[b], case.logits[b])
        return r.num_accepted, r.emitted, 1.0
    probs = torch.stack([target_probs(row, p) for row in case.logits[b]])
    r = verify_sampled_keyed(case.drafts[b], case.cand_ids[b], case.draft_probs[b], probs, p.seed, int(case.anchors[b]))
    vocab, s = probs.shape[-1], int(case.anchors[b])
    # every row up to the final draw's decides something: its top-p cut must not be a near tie either
    margin = min(top_p_margin(case.logits[b, i], p) for i in range(min(r.num_accepted, len(case.drafts[b])) + 1))
    weights, u = probs[-1].double(), uniform(p.seed, s, Purpose.BONUS)
    for i in range(min(r.num_accepted + 1, case.drafts.shape[1])):
        y = int(case.drafts[b, i])
        q = draft_row_on_vocab(case.cand_ids[b, i], case.draft_probs[b, i], y, vocab)
        pv = probs[i].double()
        if q is None:
            weights, u = pv, uniform(p.seed, s, Purpose.RESIDUAL)
            break
        lhs, rhs = uniform(p.seed, s, Purpose.ACCEPT, i + 1) * float(q[y]), float(pv[y])
        margin = min(margin, abs(lhs - rhs) / max(lhs, rhs))
        if i == r.num_accepted:
            weights, u = residual_probs(pv, q), uniform(p.seed, s, Purpose.RESIDUAL)
    cdf = torch.cumsum(weights, dim=0)
    margin = min(margin, float((cdf - u * cdf[-1]).abs().min() / cdf[-1]))
    return r.num_accepted, r.emitted, margin


def check_verify(fn, case: Case, device: str, st: SamplingTensors | None = None) -> int:
    """Assert EXACT agreement on every request away from near-ties; return how many were checked."""
    k = case.drafts.shape[1]
    st = st if st is not None else SamplingTensors.from_params(case.params, device)
    num_accepted, emitted = fn(case.logits.to(device), st, case.drafts.to(device), case.cand_ids.to(device),
                               case.draft_probs.to(device), case.anchors.to(device))
    num_accepted, emitted = num_accepted.cpu(), emitted.cpu()
    checked = 0
    for b in range(len(case.params)):
        ref_accepted, ref_emitted, margin = reference_result(case, b)
        if margin < NEAR_TIE:
            continue
        checked += 1
        padded = ref_emitted + [EMPTY] * (k + 1 - len(ref_emitted))
        assert (int(num_accepted[b]), emitted[b].tolist()) == (ref_accepted, padded), \
            f"request {b} ({case.params[b]}): fast {int(num_accepted[b])} {emitted[b].tolist()}, " \
            f"reference {ref_accepted} {padded}"
    return checked


@pytest.mark.parametrize("k,ksel,vocab", [(1, 1, 29), (2, 3, 61), (3, 5, 29), (4, 2, 47), (5, 4, 61), (6, 6, 31),
                                          (7, 7, 33)])
def test_verify_matches_reference(impl_device, k, ksel, vocab):
    impl, device = impl_device
    # the interpreter runs each Triton program in Python: fewer requests there
    batch = 12 if (impl, device) == ("triton", "cpu") else 24
    case = make_case(batch=batch, k=k, ksel=ksel, vocab=vocab, seed=100 * k + ksel)
    checked = check_verify(pick(impl, verify_torch, verify_triton), case, device)
    assert checked >= len(case.params) - 2


def stress_case(k: int = 2, ksel: int = 4, seed: int = 17) -> Case:
    """``make_case``'s drafts over target rows at the filter's edges: request b's k + 1 rows are stress rows
    b, b+1, .. (mod their count) under stress row b's parameters with a fresh seed; greedy and sampled mixed."""
    rows = stress_rows()
    base = make_case(batch=len(rows), k=k, ksel=ksel, vocab=rows[0][1].numel(), seed=seed)
    logits = torch.stack([torch.stack([rows[(b + i) % len(rows)][1] for i in range(k + 1)]) for b in range(len(rows))])
    params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=1000 + b)
              for b, (_, _, p) in enumerate(rows)]
    # the drafts' candidates include each row's target argmax; every other sampled request drafts it
    cand_ids = base.cand_ids.clone()
    cand_ids[..., 0] = logits[:, :k].argmax(dim=-1)
    drafts = torch.where(torch.arange(len(rows))[:, None] % 2 == 0, cand_ids[..., 0], base.drafts)
    for b, p in enumerate(params):
        if p.greedy:  # the argmax prefix, broken at slot b % (k + 1)
            drafts[b] = logits[b, :k].argmax(dim=-1)
            if b % (k + 1) < k:
                drafts[b, b % (k + 1)] = (drafts[b, b % (k + 1)] + 1) % logits.shape[-1]
    return Case(params, logits, drafts, cand_ids, base.draft_probs, base.anchors)


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_verify_stress_rows(impl_device, config):
    impl, device = impl_device
    if impl == "torch" and config != "default":
        pytest.skip("launch shapes are the Triton path's")
    case = stress_case()
    fn = pick(impl, verify_torch, functools.partial(verify_triton, config=CONFIGS[config]))
    assert check_verify(fn, case, device) >= len(case.params) - 3
    if impl == "triton" and config == "default":  # unknown parameters: every launch runs, the same tokens
        st = SamplingTensors.from_params(case.params, device)
        check_verify(fn, case, device, SamplingTensors(st.temperature, st.top_k, st.top_p, st.seeds))


def test_verify_greedy_batch(impl_device):
    """Every request greedy: the argmax-only path (no filter), ties to the lowest id."""
    impl, device = impl_device
    case = make_case(batch=12, k=4, ksel=3, vocab=37, seed=71)
    case.params = [SamplingParams(temperature=0.0, seed=b) for b in range(12)]
    case.logits[::3, :, 5] = case.logits[::3, :, 9] = case.logits[::3].max(dim=-1).values + 1.0  # tied maxima
    for b in range(12):
        case.drafts[b] = case.logits[b, :4].argmax(dim=-1)
        if b % 5 < 4:
            case.drafts[b, b % 5] = (case.drafts[b, b % 5] + 1) % 37
    st = SamplingTensors.from_params(case.params, device)
    assert st.host == HostSummary(False, False, False, -1)
    assert check_verify(pick(impl, verify_torch, verify_triton), case, device, st) == 12


def test_cases_cover_acceptance_and_every_row_kind():
    """The generated cases reach full acceptance, partial acceptance and rejection at slot 1."""
    outcomes = set()
    for k, ksel, vocab in [(3, 5, 29), (7, 7, 33)]:
        case = make_case(batch=24, k=k, ksel=ksel, vocab=vocab, seed=100 * k + ksel)
        for b in range(24):
            a = reference_result(case, b)[0]
            outcomes.add("all" if a == k else "none" if a == 0 else "some")
    assert outcomes == {"all", "none", "some"}


def test_planted_bug_off_by_one_accept_slot_is_caught(monkeypatch):
    keyed = rejection.keyed_uniform_torch

    def shifted(seeds, positions, purpose, slots=0):
        return keyed(seeds, positions, purpose, slots + 1 if purpose == int(Purpose.ACCEPT) else slots)

    monkeypatch.setattr(rejection, "keyed_uniform_torch", shifted)
    with pytest.raises(AssertionError, match="request"):
        check_verify(verify_torch, make_case(batch=24, k=5, ksel=4, vocab=61, seed=504), "cpu")


@pytest.mark.parametrize("k", [3, 7])
def test_limits_verify_each_request_as_a_verify_of_its_own_k(impl_device, k):
    """``limits[b]`` drafts verified out of k: EXACTLY what a verify of the first limits[b] drafts gives (same
    keys, same draws), for every limit 0..k in one launch; a limit of 0 draws the bonus from row 0 as
    ``sample`` does with the BONUS key. Rows and drafts past a limit are poisoned: they must not matter."""
    from dflash2.fast.kernels.sampling.sampler import sample_torch, sample_triton

    impl, device = impl_device
    fn = pick(impl, verify_torch, verify_triton)
    batch = 2 * (k + 1)
    case = make_case(batch=batch, k=k, ksel=4, vocab=37, seed=900 + k)
    limits = torch.arange(batch) % (k + 1)
    logits, drafts = case.logits.clone(), case.drafts.clone()
    for b, lim in enumerate(limits.tolist()):  # what lies past the limit: NaN rows, drafts that never match
        logits[b, lim + 1:] = float("nan")
        drafts[b, lim:] = 36 - drafts[b, lim:]
    st = SamplingTensors.from_params(case.params, device)
    on = functools.partial(torch.Tensor.to, device=device)
    accepted, emitted = fn(on(logits), st, on(drafts), on(case.cand_ids), on(case.draft_probs), on(case.anchors),
                           on(limits))
    accepted, emitted = accepted.cpu(), emitted.cpu()
    for lim in range(k + 1):
        members = (limits == lim).nonzero()[:, 0]
        sub = SamplingTensors.from_params([case.params[b] for b in members.tolist()], device)
        if lim == 0:
            draw = pick(impl, sample_torch, sample_triton)
            want = draw(on(case.logits[members, 0]), sub, on(case.anchors[members]), Purpose.BONUS, 0).cpu()
            assert accepted[members].tolist() == [0] * len(members)
            assert emitted[members, 0].tolist() == want.tolist()
            assert (emitted[members, 1:] == EMPTY).all()
            continue
        want_acc, want_emitted = fn(on(case.logits[members, :lim + 1]), sub, on(case.drafts[members, :lim]),
                                    on(case.cand_ids[members, :lim]), on(case.draft_probs[members, :lim]),
                                    on(case.anchors[members]))
        assert accepted[members].tolist() == want_acc.cpu().tolist(), f"limit {lim}"
        assert emitted[members, :lim + 1].tolist() == want_emitted.cpu().tolist(), f"limit {lim}"
        assert (emitted[members, lim + 1:] == EMPTY).all()
    assert accepted.tolist() != [0] * batch  # drafts were accepted somewhere: the limits bit
