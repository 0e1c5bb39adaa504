"""DISTRIBUTION at scale: the verifier's law through the path that serves, >= 1e8 requests on the GPU lane.

The toy of conformance/distribution/test_fast_verifier_law.py (V = 6, k = 2 drafts, sparse q rows
of K = 3 candidates, q different from p), run not on the kernels but through what the engine calls:
``fast/speculative/verify.verify_ragged`` on logits shaped as the runner passes them ``[B, k+1, V]``, with
``SamplingTensors`` carrying a ``HostSummary`` (which launches the filter may skip), and once through a
CUDA graph of that call captured on static buffers and replayed with new seeds and drafts each chunk,
as the captured speculative step runs it (``StepGraphs``) (``graph_summary``: max_top_k rounded up,
greedy padding requests in the batch).

With p_i the filtered target distribution of row i (the reference's ``target_probs``: temperature,
top-k, top-p, renormalised), q_i the scatter of the draft row over its candidates,
A_i = sum_x min(p_i(x), q_i(x)) and r_i = max(0, p_i - q_i) (mass 1 - A_i), three laws, every bin
within 5 standard errors sqrt(P (1 - P) / n):

- ``first``: the first committed token ~ p_1 (the sparse-q rejection theorem);
- ``accepted``: P(a=0) = 1 - A_1, P(a=1) = A_1 (1 - A_2), P(a=2) = A_1 A_2;
- ``last``: the joint law of (a, the token emitted at a): the correction at the first rejection,
  P(0, t) = r_1(t), P(1, t) = A_1 r_2(t), or the bonus, P(2, t) = A_1 A_2 p_3(t)
  (p_2 does not depend on y_1 in this toy).

Every request also has the emitted layout checked exactly: y_1..y_a, then the token, then EMPTY.

Sizes: ``ROWS`` requests per GPU case (default 1e8, env ``DFLASH2_LAW_ROWS``) in chunks of 2^18;
drafts are drawn on the device, every request has its own seed (``seeds_tensor`` of a uint64 base
above 2^63, plus the request's index), counts accumulate on the device (a compare-and-sum, not
``torch.bincount``, whose CUDA form reads the max back to the host), and the host reads them once.
At 5 sd and n = 1e8 the test sees a bias of 5 sqrt(P (1 - P) / n) ~ 2e-4 absolute in a bin of
mass 0.2. The kernels' own deviations are far below that: uniforms are quantised to 2^-23, p is
rounded to fp32, the logits are fp32 log P (each ~1e-7).

Time on an H200 at 1e8 requests per case (bench/results/2026-12-01-h200-sampled-graphs/gpu_tests.log):
plain eager 10.1 s, filtered eager 15.3 s (verify_ragged's O(B) host grouping of requests by k
overlaps the GPU), the graph replays 12.0 s, plus compilation. DFLASH2_LAW_ROWS scales it linearly.

The CPU lane runs the same sampling and law code on verify_ragged's torch path at 2e4 requests
(partial last chunk included), and a planted bug (q misreported as uniform over the candidates,
so the verifier's q is not what the drafts were drawn from) must fail there, as must filtered samples
judged by the unfiltered law.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Callable

import pytest
import torch
from torch import Tensor

from dflash2.fast.engine.graphs.graph_step import graph_summary
from dflash2.fast.speculative.proposer import DraftProposal
from dflash2.fast.speculative.verify import verify_ragged
from dflash2.fast.kernels.sampling.philox import seeds_tensor
from dflash2.fast.kernels.sampling.sampler import HostSummary, SamplingTensors
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.sampling import target_probs

V, K, DRAFTS = 6, 3, 2
P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                  [0.05, 0.40, 0.05, 0.20, 0.10, 0.20],
                  [0.10, 0.10, 0.20, 0.20, 0.20, 0.20]], dtype=torch.float64)  # p_1, p_2, p_3 (bonus), unfiltered
CANDS = torch.tensor([[0, 1, 5], [1, 3, 4]])  # the support of q_1 (with a token p cannot produce), q_2
Q = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]], dtype=torch.float64)
LOGITS = torch.log(P.float())  # [k+1, V] fp32, -inf where p = 0

SD_BOUND = 5.0
CHUNK = 1 << 18  # requests per verify_ragged call on the GPU
CPU_ROWS, CPU_CHUNK = 20_000, 8192  # 3 chunks, the last one partial
GRAPH_PADDING = 7  # greedy padding requests at the end of every replayed batch (counted nowhere)
SEED_BASE = 0x9E3779B97F4A7C15  # above 2^63: the seeds' int64 bit patterns are negative, both key words vary


def _rows_from_env() -> int:
    raw = os.environ.get("DFLASH2_LAW_ROWS", "100000000")
    try:
        rows = int(float(raw))
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"DFLASH2_LAW_ROWS={raw!r}: expected a positive number of requests (e.g. 1e8)")
    return rows


ROWS = _rows_from_env()  # requests per GPU case


@dataclass(frozen=True)
class Case:
    """One sampling configuration shared by every request of a run."""

    name: str
    temperature: float
    top_k: int
    top_p: float
    seed_offset: int  # keeps the seeds of different cases apart

    def params(self, seed: int = 0) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed)


PLAIN = Case("plain", 1.0, -1, 1.0, 0)
# T = 0.8, top-k 4, then top-p 0.6: p_1 keeps {0, 1}, p_2 keeps {1, 3} (q_2's candidate 4 gets p = 0), p_3 keeps
# {2, 3, 4}; every top-p decision is >= 0.037 of mass from its threshold (no near tie: docs/tolerances.md)
FILTERED = Case("filtered", 0.8, 4, 0.6, 1 << 40)
GRAPHED = replace(FILTERED, seed_offset=2 << 40)  # the captured run draws its own seeds and drafts


# -- the analytic laws ----------------------------------------------------------------------------

def filtered_p(case: Case) -> Tensor:
    """p_1, p_2, p_3 after the case's filter, by the reference  # [k+1, V] fp64."""
    return torch.stack([target_probs(row, case.params()).double() for row in LOGITS])


def analytic_laws(case: Case) -> dict[str, Tensor]:
    """``first`` [V], ``accepted`` [k+1], ``last`` [(k+1) * V] (bin a * V + t), each summing to 1."""
    p = filtered_p(case)
    q = torch.zeros(DRAFTS, V, dtype=torch.float64).scatter_add_(1, CANDS, Q / Q.sum(-1, keepdim=True))
    a1, a2 = torch.minimum(p[:DRAFTS], q).sum(-1).tolist()
    residual = (p[:DRAFTS] - q).clamp_min(0.0)  # unnormalised: mass 1 - A_i
    if (residual.sum(-1) <= 0).any():
        raise ValueError("the toy needs p_i != q_i: a residual with no mass draws from p instead")
    last = torch.cat([residual[0], a1 * residual[1], a1 * a2 * p[2]])
    return {"first": p[0], "accepted": torch.tensor([1 - a1, a1 * (1 - a2), a1 * a2], dtype=torch.float64),
            "last": last}


def z_scores(counts: Tensor, probs: Tensor, n: int) -> list[float]:
    """Per-bin deviation in standard errors (inf for any count where the law has no mass)."""
    out = []
    for c, p in zip(counts.tolist(), probs.tolist()):
        if p == 0.0:
            out.append(math.inf if c else 0.0)
        else:
            out.append((c / n - p) / math.sqrt(p * (1 - p) / n))
    return out


# -- sampling through the served path -------------------------------------------------------------

NBINS = V + (DRAFTS + 1) + (DRAFTS + 1) * V  # first | accepted | last


class Tally:
    """Counts of the three laws and of malformed requests, accumulated on the device."""

    def __init__(self, device: torch.device | str):
        self.bins = torch.arange(NBINS, device=device)
        self.counts = torch.zeros(NBINS, dtype=torch.int64, device=device)
        self.malformed = torch.zeros((), dtype=torch.int64, device=device)
        self.n = 0

    def add(self, num_accepted: Tensor, emitted: Tensor, drafts: Tensor) -> None:
        """num_accepted [n], emitted [n, k+1], drafts [n, k]: no host read."""
        a = num_accepted.long()
        slot = torch.arange(DRAFTS + 1, device=a.device)[None, :]
        last = emitted.gather(1, a.clamp(0, DRAFTS)[:, None])[:, 0]
        padded = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], dim=1)
        layout_ok = (torch.where(slot < a[:, None], emitted == padded, True)
                     & torch.where(slot > a[:, None], emitted == -1, True)).all(dim=1)
        ok = layout_ok & (a >= 0) & (a <= DRAFTS) & (last >= 0) & (last < V)
        index = torch.stack([emitted[:, 0], V + a, V + DRAFTS + 1 + a * V + last], dim=1)  # [n, 3]
        index = torch.where(ok[:, None], index, -1)  # a malformed request lands in no bin
        self.counts += (index[:, :, None] == self.bins).sum(dim=(0, 1))
        self.malformed += (~ok).sum()
        self.n += a.numel()


@dataclass
class Report:
    case: str
    path: str
    n: int
    seconds: float
    z: dict[str, list[float]]
    malformed: int

    @property
    def worst(self) -> float:
        return max(abs(v) for zs in self.z.values() for v in zs)

    def print(self) -> None:
        rate = self.n / max(self.seconds, 1e-9)
        print(f"\nverifier law [{self.case}, {self.path}]: n={self.n:.3e} requests in {self.seconds:.1f} s "
              f"({rate:.3e}/s), malformed {self.malformed}, worst |z| {self.worst:.2f} (bound {SD_BOUND})")
        for name, zs in self.z.items():
            print(f"  {name:8s} " + " ".join(f"{v:+6.2f}" for v in zs))


def _fixed_inputs(case: Case, batch: int, device: torch.device | str, padding: int = 0, misreport: bool = False):
    """What stays the same over chunks: logits [B, k+1, V] (contiguous, as the runner's view), cand_ids and
    draft_probs [B, k, K], the sampling parameters (the last ``padding`` requests greedy), anchors [B]."""
    logits = LOGITS.to(device).expand(batch, DRAFTS + 1, V).contiguous()
    cand_ids = CANDS.to(device).expand(batch, DRAFTS, K).contiguous()
    reported = torch.full_like(Q, 1.0 / K) if misreport else Q
    draft_probs = reported.float().to(device).expand(batch, DRAFTS, K).contiguous()
    sampled = slice(0, batch - padding)
    temperature = torch.zeros(batch, dtype=torch.float32, device=device)
    top_k = torch.full((batch,), -1, dtype=torch.int64, device=device)
    top_p = torch.ones(batch, dtype=torch.float32, device=device)
    temperature[sampled], top_k[sampled], top_p[sampled] = case.temperature, case.top_k, case.top_p
    anchors = 7 + torch.arange(batch, device=device) % 1009  # part of every uniform's key
    return logits, cand_ids, draft_probs, (temperature, top_k, top_p), anchors


class DraftSampler:
    """y_i ~ q_i, independent over requests and slots, drawn on the device (constants copied there once)."""

    def __init__(self, seed: int, device: torch.device | str):
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        self.cdf = (Q / Q.sum(-1, keepdim=True)).cumsum(-1).to(device)  # [k, K]
        self.cands = CANDS.to(device)
        self.slots = torch.arange(DRAFTS, device=device)[None, :]

    def __call__(self, n: int) -> Tensor:  # [n, k] long
        u = torch.rand((n, DRAFTS), generator=self.gen, device=self.device, dtype=torch.float64)
        pick = (u[:, :, None] >= self.cdf[None, :, :-1]).sum(-1)  # [n, k] in 0..K-1
        return self.cands[self.slots, pick]


def request_seeds(case: Case, start: int, n: int, device: torch.device | str) -> Tensor:
    """Seeds SEED_BASE + offset + start + (0..n-1) as int64 bit patterns  # [n]. The base's bit pattern comes
    from ``seeds_tensor`` on the host (no copy to the device, no host list of n ints); the base is negative
    as int64 and far from -2^63, so adding the index does not wrap."""
    base = int(seeds_tensor([SEED_BASE + case.seed_offset + start])[0])
    return torch.arange(base, base + n, dtype=torch.int64, device=device)


Verifier = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]  # (drafts [n, k], seeds [n], n) -> accepted, emitted


def eager_verifier(case: Case, batch: int, device, misreport: bool = False) -> Verifier:
    """verify_ragged called as ``ModelRunner.verify`` calls it, one call per chunk."""
    logits, cand_ids, draft_probs, (temperature, top_k, top_p), anchors = _fixed_inputs(case, batch, device,
                                                                                        misreport=misreport)
    summary = HostSummary.of([case.params()])  # every request shares these parameters

    def run(drafts: Tensor, seeds: Tensor, n: int):
        st = SamplingTensors(temperature[:n], top_k[:n], top_p[:n], seeds, summary)
        out = verify_ragged(logits[:n], DraftProposal(drafts, cand_ids[:n], draft_probs[:n]), [DRAFTS] * n, st,
                            anchors[:n])
        return out.num_accepted, out.emitted

    return run


def graphed_verifier(case: Case, batch: int, device) -> Verifier:
    """verify_ragged captured once in a CUDA graph on static buffers (``batch`` requests, the last
    GRAPH_PADDING greedy as the step graph pads), replayed per chunk after copying in seeds and drafts."""
    logits, cand_ids, draft_probs, (temperature, top_k, top_p), anchors = _fixed_inputs(case, batch, device,
                                                                                        padding=GRAPH_PADDING)
    seeds = torch.zeros(batch, dtype=torch.int64, device=device)
    drafts = CANDS[:, 0].to(device).expand(batch, DRAFTS).contiguous()
    summary = graph_summary([case.params(), SamplingParams(temperature=0.0)])  # what the runner puts in the key
    st = SamplingTensors(temperature, top_k, top_p, seeds, summary)

    def call():
        out = verify_ragged(logits, DraftProposal(drafts, cand_ids, draft_probs), [DRAFTS] * batch, st, anchors)
        return out.num_accepted, out.emitted

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels and settles the allocator before capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    real = batch - GRAPH_PADDING

    def run(new_drafts: Tensor, new_seeds: Tensor, n: int):
        if n != real:
            raise ValueError(f"n={n}: a replay verifies exactly {real} real requests")
        drafts[:n].copy_(new_drafts)
        seeds[:n].copy_(new_seeds)
        graph.replay()
        return outputs[0][:n], outputs[1][:n]

    # The graph reads its inputs at the addresses they had at capture. ``call`` alone refers to the fixed
    # ones (logits, candidates, q, parameters, anchors), and it is dropped when this function returns, so
    # without this their memory went back to the allocator and later tensors overwrote what the replays
    # read (this test once failed with 16% malformed rows for that reason, the verifier being right).
    run.graph, run.inputs = graph, (logits, cand_ids, draft_probs, st, anchors)
    return run


def sample_law(case: Case, verifier: Verifier, rows: int, chunk: int, device, path: str,
               law: Case | None = None) -> Report:
    """Run ``rows`` requests of ``case`` through ``verifier`` in chunks of ``chunk`` and compare them with the
    analytic laws of ``law`` (default: ``case``); the host reads the counts once."""
    draw_drafts = DraftSampler(case.seed_offset + 1, device)
    tally = Tally(device)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    began = time.perf_counter()
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        drafts = draw_drafts(n)
        accepted, emitted = verifier(drafts, request_seeds(case, start, n, device), n)
        tally.add(accepted, emitted, drafts)
    counts = tally.counts.cpu()  # the one read-back (waits for the last chunk)
    seconds = time.perf_counter() - began
    laws = analytic_laws(law or case)
    parts = dict(zip(laws, torch.split(counts, [V, DRAFTS + 1, (DRAFTS + 1) * V])))
    z = {name: z_scores(parts[name], laws[name], tally.n) for name in laws}
    return Report(case.name, path, tally.n, seconds, z, int(tally.malformed))


def _check(report: Report) -> None:
    report.print()
    assert report.malformed == 0, f"{report.malformed} requests emitted a malformed row"
    assert report.worst < SD_BOUND, f"{report.case} [{report.path}]: worst |z| {report.worst:.2f} >= {SD_BOUND}"


# -- GPU lane: >= 1e8 requests per case ---------------------------------------------------------------

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("case", [PLAIN, FILTERED], ids=lambda c: c.name)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the 1e8-request law runs on the GPU lane")
def test_law_at_scale_through_verify_ragged(case):
    _check(sample_law(case, eager_verifier(case, CHUNK, "cuda"), ROWS, CHUNK, "cuda", "verify_ragged eager"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the 1e8-request law runs on the GPU lane")
def test_law_at_scale_through_a_captured_verify_ragged():
    real = CHUNK - GRAPH_PADDING
    rows = -(-ROWS // real) * real  # whole replays
    _check(sample_law(GRAPHED, graphed_verifier(GRAPHED, CHUNK, "cuda"), rows, real, "cuda", "CUDA graph replay"))


# -- CPU lane: the same code on verify_ragged's torch path --------------------------------------

@pytest.mark.parametrize("case", [PLAIN, FILTERED], ids=lambda c: c.name)
def test_law_code_on_the_torch_path(case):
    _check(sample_law(case, eager_verifier(case, CPU_CHUNK, "cpu"), CPU_ROWS, CPU_CHUNK, "cpu", "verify_ragged torch"))


def test_filtered_case_changes_p():
    """The filtered case is a different law: tokens lose all mass and the rest gain some."""
    plain, filtered = filtered_p(PLAIN), filtered_p(FILTERED)
    assert (filtered[:, :] == 0).sum() > (plain == 0).sum()
    assert filtered[1, 4] == 0 and plain[1, 4] > 0  # q_2's candidate 4 can never be accepted
    assert torch.allclose(filtered.sum(-1), torch.ones(3, dtype=torch.float64))


def test_planted_bug_misreported_q_fails_at_the_small_size():
    report = sample_law(PLAIN, eager_verifier(PLAIN, CPU_CHUNK, "cpu", misreport=True), CPU_ROWS, CPU_CHUNK, "cpu",
                        "planted bug: q reported uniform")
    report.print()
    assert report.malformed == 0
    assert max(abs(z) for z in report.z["first"]) > SD_BOUND  # the theorem's own law breaks, not only A_i


def test_planted_bug_unfiltered_law_fails_at_the_small_size():
    """Filtered samples judged by the unfiltered p must fail: the check sees what the filter does."""
    report = sample_law(FILTERED, eager_verifier(FILTERED, CPU_CHUNK, "cpu"), CPU_ROWS, CPU_CHUNK, "cpu",
                        "planted bug: law of the unfiltered p", law=PLAIN)
    report.print()
    assert report.malformed == 0
    assert report.worst > SD_BOUND


def test_rows_override_is_validated(monkeypatch):
    monkeypatch.setenv("DFLASH2_LAW_ROWS", "2e4")
    assert _rows_from_env() == 20_000
    monkeypatch.setenv("DFLASH2_LAW_ROWS", "lots")
    with pytest.raises(ValueError, match="DFLASH2_LAW_ROWS"):
        _rows_from_env()


def test_tally_puts_each_request_in_its_bins_and_counts_malformed_ones():
    drafts = torch.tensor([[0, 3], [1, 4], [5, 1], [0, 1]])
    num_accepted = torch.tensor([1, 2, 0, 1])
    emitted = torch.tensor([[0, 2, -1],  # y_1, correction 2 at a = 1
                            [1, 4, 3],  # both accepted, bonus 3
                            [4, -1, -1],  # correction 4 at a = 0
                            [0, 3, 5]])  # malformed: a token after the correction
    tally = Tally("cpu")
    tally.add(num_accepted, emitted, drafts)
    first, accepted, last = torch.split(tally.counts, [V, DRAFTS + 1, (DRAFTS + 1) * V])
    assert first.tolist() == [1, 1, 0, 0, 1, 0]
    assert accepted.tolist() == [1, 1, 1]
    assert last.nonzero()[:, 0].tolist() == [4, V + 2, 2 * V + 3]
    assert int(tally.malformed) == 1 and tally.n == 4
