"""FastDFlashProposer vs one reference DFlashProposer per request, through whole speculative lives.

Four requests share every call: anchors below W-1 committed rows, at exactly W-1, past it, and a
wrapped ring; a chunked prefill; greedy (temperature 0, and top_k 1 at temperature 1) and sampled
requests (several temperatures, the largest seed) in one batch. Each step compares the rings
(EXACT positions and tags, NUMERIC values), the drafted tokens and candidates (EXACT under the
same keyed uniforms, up to a slot the reference decides by a near tie) and q (NUMERIC), then
simulates a verify: k+1 rows written before acceptance is known, the rejected ones with NaN
features, so any read of them fails the next step. Then: a ring rebuilt from the dflash_window
equals the live ring bitwise, a prefill running 65 rows past a snapshot boundary keeps the
boundary's window intact (66 do not), and planted bugs (a ring slot off by one, a window one row
too wide, RoPE at the wrong position, no margin) make this suite fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash2.fast.kernels.sampling.philox import seeds_tensor
import dflash2.fast.model.draft as draft_module
from dflash2.fast.model.draft import FastDraft
from dflash2.fast.speculative.dflash import FastDFlashProposer
from dflash2.fast.speculative.ring import RingPool, StaleSlotError
from dflash2.reference.speculative.dflash import DFlashProposer
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.model.target import TargetOutput
from draft_harness import DEVICE, ErrorLog, features_of, first_near_tie, new_log, random_taps, reference_walk

NUM_SLOTS = 8
SPARE_SLOTS = (2, 4, 7, 1)  # slots no request uses: prefix-cache snapshots and restores
REQUESTS = (  # prompt length, GDN slot, sampling
    (3, 5, SamplingParams(temperature=0.0)),
    (23, 0, SamplingParams(temperature=0.8, seed=11)),
    (40, 3, SamplingParams(temperature=1.0, top_k=1, seed=3)),
    (150, 6, SamplingParams(temperature=1.3, seed=2**64 - 1)),
)
STEP_KS = (7, 7, 3, 1, 7, 5)


@dataclass
class Request:
    reference: DFlashProposer
    slot: int
    params: SamplingParams
    anchor_position: int
    anchor_token: int


class Life:
    """The fast proposer and the reference proposers, driven through the same steps."""

    def __init__(self, pair, target_cfg, fast: FastDFlashProposer, seed: int = 0, report: bool = True):
        self.pair, self.target_cfg, self.fast = pair, target_cfg, fast
        self.cfg = pair.reference.cfg
        self.gen = torch.Generator().manual_seed(seed)
        self.log = new_log("proposer") if report else ErrorLog("planted")
        self.reqs: list[Request] = []
        self.near_ties = 0  # walks cut short by a near tie in the reference
        self.slots_compared = 0  # slots compared EXACT (before any near tie)

    def taps(self, rows: int) -> tuple[torch.Tensor, ...]:
        return random_taps(self.target_cfg.num_hidden_layers, rows, self.target_cfg.hidden_size, self.gen)

    def token(self) -> int:
        return int(torch.randint(0, self.cfg.vocab_size, (), generator=self.gen))

    def observe(self, writes: list[tuple[Request, int, tuple[torch.Tensor, ...], int]]) -> None:
        """Each (request, first position, taps, committed rows) to its reference; all rows in one fast call."""
        slots, positions, features = [], [], []
        for req, first, taps, committed in writes:
            rows = taps[0].shape[0]
            req.reference.observe([0] * rows, first, TargetOutput(None, None, taps), committed)
            slots.append(torch.full((rows,), req.slot))
            positions.append(torch.arange(first, first + rows))
            features.append(features_of(taps, self.cfg.target_layer_ids))
        self.fast.observe_rows(torch.cat(slots).to(DEVICE), torch.cat(positions).to(DEVICE), torch.cat(features).to(DEVICE))

    def prefill(self, requests=REQUESTS) -> None:
        """Every prompt in one call, except that the longest runs as two chunks (the second alone)."""
        first_call, second_call = [], []
        for n, slot, params in requests:
            req = Request(DFlashProposer(self.pair.reference), slot, params, n, self.token())
            self.reqs.append(req)
            taps = self.taps(n)
            cut = 100 if n > 100 else n
            first_call.append((req, 0, tuple(t[:cut] for t in taps), cut))
            if cut < n:
                second_call.append((req, cut, tuple(t[cut:] for t in taps), n - cut))
        self.observe(first_call)
        if second_call:
            self.observe(second_call)

    def tensors(self, slots=None):
        reqs = self.reqs
        slots = torch.tensor([r.slot for r in reqs] if slots is None else slots, device=DEVICE)
        return (torch.tensor([r.anchor_token for r in reqs], device=DEVICE),
                torch.tensor([r.anchor_position for r in reqs], device=DEVICE), slots,
                torch.tensor([r.params.greedy for r in reqs], device=DEVICE),
                torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=DEVICE),
                seeds_tensor([r.params.seed for r in reqs], DEVICE))

    def propose(self, k: int, slots=None):
        """The fast proposal, on the CPU."""
        tokens, anchors, slots, greedy, temperatures, seeds = self.tensors(slots)
        out = self.fast.propose_drafts(tokens, anchors, slots, k, greedy, temperatures, seeds)
        return type(out)(out.tokens.cpu(), out.cand_ids.cpu(), out.draft_probs.cpu())

    def compare_rings(self) -> None:
        _, anchors, slots, *_ = self.tensors()
        self.fast.ring.check_readable(slots, anchors)  # EXACT: every readable row is tagged with its position
        for layer in range(self.cfg.num_hidden_layers):
            k, v, valid = self.fast.ring.gather(layer, slots, anchors)
            for b, req in enumerate(self.reqs):
                positions, rows = req.reference.ring.read(req.anchor_position)
                read = anchors[b] - self.cfg.sliding_window + 1 + torch.nonzero(valid[b]).squeeze(1)
                assert torch.equal(read.cpu(), positions), f"request {b}: reads {read.tolist()}"
                self.log.add("ring k", k[b][valid[b]], rows[:, layer, 0])
                self.log.add("ring v", v[b][valid[b]], rows[:, layer, 1])

    def step(self, k: int) -> None:
        """Compare, propose, then verify k+1 rows per request with a random number accepted."""
        self.compare_rings()
        proposal = self.propose(k)
        writes = []
        for b, req in enumerate(self.reqs):
            ref = req.reference
            expected = ref.propose(req.anchor_token, req.anchor_position, k, req.params)
            walk, block = reference_walk(ref.draft, ref.selector, ref.ring, req.anchor_token, req.anchor_position,
                                         k, req.params)
            assert torch.equal(walk.tokens, expected.tokens)
            tie = first_near_tie(walk, block, req.params, req.anchor_position, self.cfg.selector_top_k)
            self.near_ties += tie < k
            self.slots_compared += tie
            assert torch.equal(proposal.cand_ids[b, :tie], expected.cand_ids[:tie]), f"request {b}: candidates differ"
            assert torch.equal(proposal.tokens[b, :tie], expected.tokens[:tie]), f"request {b}: drafted tokens differ"
            if tie:
                self.log.add("q (draft_probs)", proposal.draft_probs[b, :tie], expected.draft_probs[:tie])
            accepted = int(torch.randint(0, k + 1, (), generator=self.gen))
            taps = self.taps(k + 1)
            for t in taps:
                t[accepted + 1:] = float("nan")  # rejected rows: written, never to be read
            writes.append((req, req.anchor_position, taps, accepted + 1))
        self.observe(writes)
        for req, (_, _, _, committed) in zip(self.reqs, writes):
            req.anchor_position += committed
            req.anchor_token = self.token()


@pytest.fixture()
def life(small_window, tiny_target):
    _, target_cfg, _ = tiny_target
    life = Life(small_window, target_cfg, FastDFlashProposer(small_window.fast, NUM_SLOTS, poison=True,
                                                             num_snapshots=len(SPARE_SLOTS)))
    life.prefill()
    return life


def test_proposer_follows_the_reference_through_verify_steps(life):
    for k in STEP_KS:
        life.step(k)
    life.compare_rings()
    assert life.near_ties <= 4 and life.slots_compared >= 90, (life.near_ties, life.slots_compared)  # of 120


def test_ring_rebuilt_from_the_window_equals_the_live_ring_bitwise(life):
    for k in STEP_KS[:3]:
        life.step(k)
    fast = life.fast
    _, anchors, live, *_ = life.tensors()
    spare = torch.tensor(SPARE_SLOTS, device=DEVICE)
    saved = torch.arange(len(SPARE_SLOTS), device=DEVICE)
    fast.save_state(live, saved)  # the snapshot, beside the GDN state's
    fast.load_state(saved, spare, anchors)  # a prefix hit at each request's frontier: window, then ring rebuild
    fast.ring.check_readable(spare, anchors)
    for layer in range(life.cfg.num_hidden_layers):
        for rebuilt, held in zip(fast.ring.gather(layer, spare, anchors), fast.ring.gather(layer, live, anchors)):
            assert torch.equal(rebuilt, held)
    for k in (7, 2):
        from_live, from_rebuilt = life.propose(k), life.propose(k, SPARE_SLOTS)
        for a, b in zip((from_live.tokens, from_live.cand_ids, from_live.draft_probs),
                        (from_rebuilt.tokens, from_rebuilt.cand_ids, from_rebuilt.draft_probs)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows_past", [65, 66])
def test_a_prefill_past_a_snapshot_boundary_keeps_the_window(small_window, tiny_target, rows_past):
    """Rows f..f+64 (65 = margin + 1) past the boundary f leave the rows f reads intact; a 66th overwrites one."""
    _, target_cfg, _ = tiny_target
    fast = FastDFlashProposer(small_window.fast, 2, poison=True, num_snapshots=1)
    cfg = small_window.fast.cfg
    gen = torch.Generator().manual_seed(9)
    boundary, slot, spare = 100, torch.tensor([0], device=DEVICE), torch.tensor([1], device=DEVICE)
    anchor = torch.tensor([boundary], device=DEVICE)
    width = cfg.num_taps * cfg.hidden_size
    fast.observe_rows(slot.expand(boundary), torch.arange(boundary, device=DEVICE),
                 torch.randn(boundary, width, generator=gen).to(DEVICE))
    layers = range(cfg.num_hidden_layers)
    at_boundary = [tuple(t.clone() for t in fast.ring.gather(layer, slot, anchor)) for layer in layers]
    fast.observe_rows(slot.expand(rows_past), torch.arange(boundary, boundary + rows_past, device=DEVICE),
                 torch.randn(rows_past, width, generator=gen).to(DEVICE))
    saved = torch.tensor([0], device=DEVICE)
    fast.save_state(slot, saved)
    fast.window.load(saved, spare)
    if rows_past == 66:
        with pytest.raises(StaleSlotError):
            fast.ring.check_readable(slot, anchor)
        with pytest.raises(StaleSlotError):
            fast.window.check_readable(spare, anchor)
        return
    fast.ring.check_readable(slot, anchor)
    fast.restore(spare, anchor)
    for layer, saved in enumerate(at_boundary):
        for which in (slot, spare):
            assert all(torch.equal(a, b) for a, b in zip(fast.ring.gather(layer, which, anchor), saved))


def _short_life(small_window, tiny_target, **proposer_args) -> None:
    _, target_cfg, _ = tiny_target
    fast = FastDFlashProposer(small_window.fast, NUM_SLOTS, poison=True, **proposer_args)
    life = Life(small_window, target_cfg, fast, report=False)
    life.prefill()
    for k in (7, 7, 7):
        life.step(k)
    life.compare_rings()


def test_the_short_life_passes_unplanted(small_window, tiny_target):
    _short_life(small_window, tiny_target)


def test_planted_ring_bugs_fail_this_suite(small_window, tiny_target, monkeypatch):
    write, context_kv, attention = RingPool.write, FastDraft.context_kv, draft_module.ring_attention
    planted = [
        (RingPool, "write", lambda self, slots, positions, k, v: write(self, slots, positions + 1, k, v)),  # slot + 1
        (draft_module, "ring_attention", lambda *args: attention(*args[:-1], args[-1] + 1)),  # window one too wide
        (FastDraft, "context_kv", lambda self, rows, positions: context_kv(self, rows, positions + 1)),  # RoPE at p+1
    ]
    for owner, name, bug in planted:
        with monkeypatch.context() as m:
            m.setattr(owner, name, bug)
            with pytest.raises((AssertionError, StaleSlotError)):
                _short_life(small_window, tiny_target)
    with pytest.raises((AssertionError, StaleSlotError)):  # no margin: rejected verify rows alias readable ones
        _short_life(small_window, tiny_target, margin=0)
