"""A tiny world for exact verification tests: a prefix-dependent target, path-conditional drafts,
and the exact integral of a verifier over its uniforms.

Target: p(. | prefix) over V tokens, a fixed function of the prefix (some prefixes cut the least
likely token, as top-k would). Draft: for each prefix a reported row (cand_ids, draft_probs), as the
verifier sees it, and the law the proposer actually drew y from (the two differ for NaN,
wrong-total, zero-mass and outside-the-row rows: that is the point).

Exact integral. The verifier is a function of (accept_u_1..k, residual_u, bonus_u), piecewise
constant in each: it can change only where accept_u_i crosses min(1, p_i(y_i) / q_i(y_i)) or
where residual_u / bonus_u cross a step of the CDF of a distribution it may sample (p_i, r_i,
p_{k+1}). Cutting (0, 1) at all of those, evaluating the verifier at the centre of every cell of
the product grid and weighting by the cell's volume is its exact integral when its cuts are
among ours; ``certify`` also evaluates near two opposite corners of every cell and demands the
same result, which catches a verifier that changes inside a cell.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

import torch

V = 4


def key(prefix: tuple[int, ...], salt: int) -> int:
    s = salt
    for t in prefix:
        s = (s * 131 + t + 1) % (2**31 - 1)
    return s


@lru_cache(maxsize=None)
def target_p(prefix: tuple[int, ...]) -> torch.Tensor:
    """p(. | prefix)  # [V] float64, sums to 1; every third prefix has a zero (a top-k cut)."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(key(prefix, 1)), dtype=torch.float64)
    p = torch.softmax(1.5 * logits, dim=0)
    if key(prefix, 2) % 3 == 0:
        p[int(torch.argmin(p))] = 0.0
    return p / p.sum()


@dataclass(frozen=True)
class DraftRow:
    cand_ids: tuple[int, ...]  # [K] what the verifier is told
    draft_probs: tuple[float, ...]  # [K]
    law: dict[int, float]  # how the proposer really drew y (support may leave the row)


def sparse_row(prefix: tuple[int, ...], num_cands: int) -> DraftRow:
    """A selector-like row: top-K of draft logits near the target's, softmax over those K."""
    gen = torch.Generator().manual_seed(key(prefix, 3))
    logits = torch.log(target_p(prefix) + 0.05) + torch.randn(V, generator=gen, dtype=torch.float64)
    cands = torch.sort(-logits, stable=True).indices[:num_cands]
    probs = torch.softmax(logits[cands], dim=0)
    return DraftRow(tuple(cands.tolist()), tuple(probs.tolist()), dict(zip(cands.tolist(), probs.tolist())))


def one_hot_row(prefix: tuple[int, ...], num_cands: int) -> DraftRow:
    y = sparse_row(prefix, 1).cand_ids[0]
    return DraftRow((y,), (1.0,), {y: 1.0})


def wrong_total_row(prefix: tuple[int, ...], num_cands: int) -> DraftRow:
    row = sparse_row(prefix, num_cands)
    scale = (0.25, 3.0, 1e-3)[key(prefix, 4) % 3]
    return DraftRow(row.cand_ids, tuple(scale * q for q in row.draft_probs), row.law)


def nan_row(prefix: tuple[int, ...], num_cands: int) -> DraftRow:
    """Every other prefix: a NaN entry; the proposer fell back to its first candidate."""
    row = sparse_row(prefix, num_cands)
    if key(prefix, 5) % 2:
        return row
    return DraftRow(row.cand_ids, (math.nan,) + row.draft_probs[1:], {row.cand_ids[0]: 1.0})


def untrusted_mix_row(prefix: tuple[int, ...], num_cands: int) -> DraftRow:
    """Each prefix picks one kind: trusted, inf, negative, zero-sum, zero mass at y, or y outside the row."""
    row = sparse_row(prefix, num_cands)
    ids, probs = row.cand_ids, row.draft_probs
    kind = key(prefix, 6) % 6
    if kind == 1:
        return DraftRow(ids, (math.inf,) + probs[1:], {ids[-1]: 1.0})
    if kind == 2:
        return DraftRow(ids, (-0.5,) + probs[1:], {i: 1 / len(ids) for i in ids})
    if kind == 3:
        return DraftRow(ids, (0.0,) * len(ids), {i: 1 / len(ids) for i in ids})
    if kind == 4:  # the row says ids[0] has no mass, the proposer still drew it 40% of the time
        rest = sum(probs[1:])
        law = {ids[0]: 0.4} | {i: 0.6 * q / rest for i, q in zip(ids[1:], probs[1:])}
        return DraftRow(ids, (0.0,) + tuple(q / rest for q in probs[1:]), law)
    if kind == 5:  # 30% of draws land outside the row; within it the row's law
        outside = next(t for t in range(V) if t not in ids)
        return DraftRow(ids, probs, {outside: 0.3} | {i: 0.7 * q for i, q in zip(ids, probs)})
    return row


SCENARIOS = {"sparse": sparse_row, "one_hot": one_hot_row, "wrong_total": wrong_total_row,
             "nan": nan_row, "untrusted_mix": untrusted_mix_row}


def trusted_q(row: DraftRow, y: int) -> torch.Tensor | None:
    """The test's own reading of a row: q over the vocabulary, or None if untrusted  # [V]."""
    probs = torch.tensor(row.draft_probs, dtype=torch.float64)
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()) or float(probs.sum()) <= 0:
        return None
    q = torch.zeros(V, dtype=torch.float64).index_add_(0, torch.tensor(row.cand_ids), probs / probs.sum())
    return q if q[y] > 0 else None


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0.0)
    return r / r.sum() if r.sum() > 0 else p


def draft_paths(scenario: str, prefix: tuple[int, ...], k: int, num_cands: int):
    """Every draft path from ``prefix``: (tokens, rows, probability)."""
    make = SCENARIOS[scenario]
    paths = [((), (), 1.0)]
    for _ in range(k):
        grown = []
        for tokens, rows, w in paths:
            row = make(prefix + tokens, num_cands)
            grown += [(tokens + (y,), rows + (row,), w * qy) for y, qy in row.law.items() if qy > 0]
        paths = grown
    return paths


def verify_inputs(prefix, tokens, rows):
    k = len(tokens)
    return dict(draft_tokens=torch.tensor(tokens, dtype=torch.long).reshape(k),
                cand_ids=torch.tensor([r.cand_ids for r in rows], dtype=torch.long).reshape(k, -1),
                draft_probs=torch.tensor([r.draft_probs for r in rows], dtype=torch.float64).reshape(k, -1),
                target_probs=torch.stack([target_p(prefix + tokens[:i]) for i in range(k + 1)]))


def cdf_cuts(probs: torch.Tensor) -> list[float]:
    return (torch.cumsum(probs, 0) / probs.sum()).tolist()


def cells(cuts) -> list[tuple[float, float]]:
    points = sorted({0.0, 1.0} | {c for c in cuts if 0.0 < c < 1.0})
    return [(a, b) for a, b in zip(points, points[1:]) if b > a]


def integrate_verifier(verify, prefix, tokens, rows, certify: bool = False) -> dict[tuple[int, ...], float]:
    """The exact law of ``verify``'s emitted tokens for one draft path  # {emitted: probability}."""
    inputs = verify_inputs(prefix, tokens, rows)
    p = inputs["target_probs"]
    accept_cuts, residual_cuts = [], []
    for i, (y, row) in enumerate(zip(tokens, rows)):
        q = trusted_q(row, y)
        accept_cuts.append([] if q is None else [min(1.0, float(p[i, y] / q[y]))])
        residual_cuts += cdf_cuts(p[i]) + ([] if q is None else cdf_cuts(residual(p[i], q)))
    axes = [cells(c) for c in accept_cuts] + [cells(residual_cuts), cells(cdf_cuts(p[-1]))]
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for cell in itertools.product(*axes):
        def run(frac):
            u = [a + frac * (b - a) for a, b in cell]
            return tuple(verify(**inputs, accept_u=u[:-2], residual_u=u[-2], bonus_u=u[-1]).emitted)
        emitted = run(0.5)
        if certify:
            assert run(1e-6) == emitted == run(1 - 1e-6), f"verifier not constant on cell {cell}"
        law[emitted] += math.prod(b - a for a, b in cell)
    return law


def analytic_step(prefix, tokens, rows) -> dict[tuple[int, ...], float]:
    """The spec's law of emitted tokens for one draft path, from min(1, p/q) and the residual law."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    reach = 1.0  # probability that slots 1..i were all accepted
    for i, (y, row) in enumerate(zip(tokens, rows)):
        p = target_p(prefix + tokens[:i])
        q = trusted_q(row, y)
        accept = 0.0 if q is None else min(1.0, float(p[y] / q[y]))
        draw = p if q is None else residual(p, q)
        for x in range(V):
            law[tokens[:i] + (x,)] += reach * (1 - accept) * float(draw[x])
        reach *= accept
    bonus = target_p(prefix + tokens)
    for x in range(V):
        law[tokens + (x,)] += reach * float(bonus[x])
    return law


def committed_law(step_law, prefix: tuple[int, ...], n: int) -> dict[tuple[int, ...], float]:
    """Law of the first n committed tokens after ``prefix``, running steps until n are out."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for emitted, w in step_law(prefix).items():
        if len(emitted) >= n:
            out[emitted[:n]] += w
        else:
            for rest, w2 in committed_law(step_law, prefix + emitted, n - len(emitted)).items():
                out[emitted + rest] += w * w2
    return out


def target_law(prefix: tuple[int, ...], n: int) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=n):
        out[seq] = math.prod(float(target_p(prefix + seq[:j])[seq[j]]) for j in range(n))
    return out


def step_law_of(verify, scenario: str, k: int, num_cands: int, certify: bool = False, analytic: bool = False):
    """prefix -> law of one verify step's emitted tokens, averaged over the draft paths (memoised)."""
    @lru_cache(maxsize=None)
    def step_law(prefix):
        law: dict[tuple[int, ...], float] = defaultdict(float)
        for tokens, rows, w in draft_paths(scenario, prefix, k, num_cands):
            one = analytic_step(prefix, tokens, rows) if analytic else \
                integrate_verifier(verify, prefix, tokens, rows, certify)
            for emitted, w2 in one.items():
                law[emitted] += w * w2
        return dict(law)
    return step_law


def max_law_error(got: dict, want: dict) -> float:
    return max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want))
