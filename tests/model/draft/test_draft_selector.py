"""The candidate selector: candidate order, the greedy walk vs brute force, q and its draws."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.reference.model.draft import DraftBlockOutput
from dflash2.reference.request.rng import Purpose, uniform
from dflash2.reference.speculative.selector import CandidateSelector, select, selector_uniforms, top_candidates


def toy(seed=0, vocab=12, hidden=6, rank=4, rows=4, top_k=4, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    selector = CandidateSelector(torch.randn(rank, hidden, generator=gen),
                                 scale * torch.randn(vocab, rank, generator=gen),
                                 scale * torch.randn(vocab, rank, generator=gen), top_k)
    block = DraftBlockOutput(hidden=torch.randn(rows, hidden, generator=gen),
                             logits=torch.randn(rows - 1, vocab, generator=gen))
    return selector, block


def brute_force_walk(block, selector, anchor, k, temperature=None, uniforms=None):
    """Python-list recomputation: sort by (-logit, id); sum over r; first maximum; explicit CDF."""
    tokens, qs = [], []
    prev = anchor
    for i in range(1, k + 1):
        z = block.logits[i - 1].tolist()
        cands = sorted(range(len(z)), key=lambda t: (-z[t], t))[:selector.top_k]
        g = [sum(selector.hidden_projection[a, c].item() * block.hidden[i, c].item()
                 for c in range(block.hidden.shape[1])) for a in range(selector.hidden_projection.shape[0])]
        sigma = [z[b] + sum(selector.predecessor_codebook[prev, r].item() * g[r] *
                            selector.successor_codebook[b, r].item() for r in range(len(g))) for b in cands]
        if uniforms is None:
            pick = max(range(len(sigma)), key=lambda j: (sigma[j], -j))
        else:
            top = max(sigma)
            e = [math.exp((x - top) / temperature) for x in sigma]
            q = [x / sum(e) for x in e]
            qs.append(q)
            acc, pick = 0.0, len(q) - 1
            for j, p in enumerate(q):
                acc += p
                if acc > uniforms[i - 1]:
                    pick = j
                    break
        prev = cands[pick]
        tokens.append(prev)
    return tokens, qs


def test_candidates_logit_descending_ties_by_id():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 0.5, 3.0])
    ids, values = top_candidates(logits, 5)
    assert ids.tolist() == [1, 3, 6, 2, 4]
    assert values.tolist() == [3.0, 3.0, 3.0, 2.0, 2.0]


@pytest.mark.parametrize("seed", range(5))
def test_greedy_walk_equals_brute_force(seed):
    selector, block = toy(seed)
    out = select(block, selector, anchor_token=seed, k=3, temperature=0.0)
    tokens, _ = brute_force_walk(block, selector, seed, 3)
    assert out.tokens.tolist() == tokens
    assert out.draft_probs.sum(-1).tolist() == [1.0] * 3 and out.draft_probs.max(-1).values.tolist() == [1.0] * 3
    picks = out.draft_probs.argmax(-1)
    assert out.tokens.tolist() == out.cand_ids.gather(1, picks[:, None])[:, 0].tolist()
    assert out.sigma.shape == out.cand_ids.shape == (3, selector.top_k)


def test_greedy_ties_pick_the_lowest_index():
    selector, block = toy(0, scale=0.0)  # no edge term: sigma = U
    block = DraftBlockOutput(hidden=block.hidden, logits=torch.zeros_like(block.logits))  # all tied
    out = select(block, selector, anchor_token=0, k=3, temperature=0.0)
    assert out.tokens.tolist() == [0, 0, 0]  # candidate 0 of each slot, the lowest id


def test_walk_stops_after_k_and_conditions_on_the_path():
    selector, block = toy(1)
    full = select(block, selector, 2, 3, 0.0)
    assert select(block, selector, 2, 1, 0.0).tokens.tolist() == full.tokens[:1].tolist()
    # slot 2's scores depend on y_1: another anchor changes slot 1's sigma, not its candidates
    other = select(block, selector, 3, 3, 0.0)
    assert torch.equal(other.cand_ids, full.cand_ids) and not torch.equal(other.sigma[0], full.sigma[0])


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
def test_sampled_q_is_softmax_of_sigma_over_t(temperature):
    selector, block = toy(2)
    u = selector_uniforms(seed=5, anchor_position=40, k=3)
    out = select(block, selector, 4, 3, temperature, u)
    torch.testing.assert_close(out.draft_probs.sum(-1), torch.ones(3))
    torch.testing.assert_close(out.draft_probs, torch.softmax(out.sigma / temperature, dim=-1))
    tokens, qs = brute_force_walk(block, selector, 4, 3, temperature, u.tolist())
    assert out.tokens.tolist() == tokens
    torch.testing.assert_close(out.draft_probs, torch.tensor(qs), rtol=1e-5, atol=1e-6)


def test_selector_uniforms_are_keyed_by_slot_one_to_k():
    u = selector_uniforms(9, 33, 4)
    assert u.tolist() == [uniform(9, 33, Purpose.SELECTOR, i) for i in (1, 2, 3, 4)]


def test_sampled_pick_never_has_zero_probability():
    """sigma = -inf (q = 0) on every other candidate: whatever the uniform, the pick has q > 0."""
    selector, block = toy(5, scale=0.0)
    logits = torch.full_like(block.logits, -float("inf"))
    logits[:, :2] = 0.0  # two live candidates per slot; two more candidates at -inf fill K_sel = 4
    block = DraftBlockOutput(block.hidden, logits)
    for u in (1e-7, 0.5, 1 - 1e-7):
        out = select(block, selector, 0, 3, 1.0, [u] * 3)
        assert (out.draft_probs.gather(1, (out.cand_ids == out.tokens[:, None]).int().argmax(1)[:, None]) > 0).all()


def test_draws_follow_q_along_the_path():
    """Monte Carlo over request seeds: the (y_1, y_2) frequencies match q_1(y_1) q_2(y_2 | y_1)."""
    selector, block = toy(3, vocab=10, top_k=4, scale=0.6)
    temperature, anchor, position, n = 1.3, 7, 50, 6000
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        out = select(block, selector, anchor, 2, temperature, selector_uniforms(seed, position, 2))
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
    first = select(block, selector, anchor, 1, temperature, [0.5])
    worst = 0.0
    for j1, y1 in enumerate(first.cand_ids[0].tolist()):
        second = select(DraftBlockOutput(block.hidden[1:], block.logits[1:]), selector, y1, 1, temperature, [0.5])
        for j2, y2 in enumerate(second.cand_ids[0].tolist()):
            p = float(first.draft_probs[0, j1] * second.draft_probs[0, j2])
            bound = 5 * math.sqrt(p * (1 - p) / n) + 2 / n
            worst = max(worst, abs(counts.get((y1, y2), 0) / n - p) / bound)
    assert worst <= 1.0
    assert sum(counts.values()) == n


def test_sampled_walk_needs_positive_temperature_and_k_uniforms():
    selector, block = toy(4)
    with pytest.raises(ValueError, match="temperature"):
        select(block, selector, 0, 2, 0.0, [0.5, 0.5])
    with pytest.raises(ValueError, match="uniforms"):
        select(block, selector, 0, 2, 1.0, [0.5])
    with pytest.raises(ValueError, match="k="):
        select(block, selector, 0, 4, 0.0)
