"""The reference prefix cache (``reference/speculative/prefix.py``) piece by piece: the store's lookup
rules, where the prefill chunks end, what a snapshot holds (the committed state, even after a
verify that rejected drafts or a stop id that cut the output short) and each proposer's
snapshot/restore. Whole restored runs against uninterrupted ones are
``conformance/tokens/test_reference_prefix_restore.py``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.formats.draft_checkpoint import load_draft
from dflash2.reference.generate import generate
from dflash2.reference.model.attention import KVCache
from dflash2.reference.model.draft import ReferenceDraft
from dflash2.reference.model.mtp import ReferenceMTP
from dflash2.reference.model.target import ReferenceTarget, TargetCache, TargetOutput
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.dflash import ContextWindow, DFlashProposer
from dflash2.reference.speculative.loop import speculative_generate
from dflash2.reference.speculative.mtp import MTPProposer
from dflash2.reference.speculative.ngram import NgramProposer
from dflash2.reference.speculative.prefix import PrefixStore, Snapshot, chunk_ends, take_snapshot
from dflash2.reference.speculative.proposer import Proposal, Proposer
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target

WINDOW = 20  # the draft's sliding window W: the ring has W + 64 = 84 slots
PROMPT = [(7 * i + 3) % 500 for i in range(21)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@dataclass
class Models:
    target: ReferenceTarget
    draft: ReferenceDraft
    mtp: ReferenceMTP


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("prefix")
    target_path = write_tiny_target(root / "target", "tiny-dense", tokenizer=None)
    draft_path = write_tiny_draft(root / "draft", target_path, seed=3, sliding_window=WINDOW)
    cfg, weights = load_target(target_path)
    draft_cfg, draft_weights = load_draft(draft_path, cfg, None)
    return Models(ReferenceTarget(cfg, weights), ReferenceDraft(draft_cfg, draft_weights, weights),
                  ReferenceMTP(cfg, weights))


def caches_equal(a: TargetCache, b: TargetCache) -> bool:
    """Bit for bit: the same length and, per layer, the same GDN conv and recurrent state or K/V rows."""
    if a.length != b.length:
        return False
    for x, y in zip(a.layers, b.layers, strict=True):
        pairs = [(x.keys, y.keys), (x.values, y.values)] if isinstance(x, KVCache) else \
            [(x.conv, y.conv), (x.recurrent, y.recurrent)]
        if not all(torch.equal(p, q) for p, q in pairs):
            return False
    return True


class Scripted(Proposer):
    """Drafts the known continuation: ``script[s+1 .. s+k]``; slots after the first ``right`` are one id off."""

    def __init__(self, script: list[int], right: int | None = None):
        self.script, self.right = script, right

    def observe(self, tokens, first_position, target_out, num_committed) -> None:
        pass

    def propose(self, anchor_token, anchor_position, k, params) -> Proposal:
        drafts = self.script[anchor_position + 1:anchor_position + 1 + k]
        if self.right is not None:
            drafts = drafts[:self.right] + [(t + 1) % 500 for t in drafts[self.right:]]
        return Proposal.deterministic(drafts)


# -- the store --------------------------------------------------------------------------------------


def fake(tokens: list[int]) -> Snapshot:
    return Snapshot(tuple(tokens), TargetCache(layers=[], length=len(tokens)), None)


def test_lookup_takes_the_longest_snapshot_that_is_a_proper_prefix():
    store = PrefixStore()
    assert store.lookup([1, 2, 3]) is None
    for tokens in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [9, 9, 9]):
        store.put(fake(tokens))
    assert store.lookup([1, 2, 3, 4, 5, 6, 7]).tokens == (1, 2, 3, 4, 5, 6)
    assert store.lookup([1, 2, 3, 4, 8]).tokens == (1, 2, 3, 4)
    assert store.lookup([1, 2, 7]).tokens == (1, 2)
    assert store.lookup([2, 1, 3]) is None
    assert store.lookup([9, 9, 9, 9]).tokens == (9, 9, 9)


def test_lookup_never_returns_the_whole_prompt():
    """f < len(prompt): the first output token needs the last prompt row's logits, so one token is prefilled."""
    store = PrefixStore()
    store.put(fake([1, 2, 3, 4]))
    assert store.lookup([1, 2, 3, 4]) is None
    store.put(fake([1, 2]))
    assert store.lookup([1, 2, 3, 4]).tokens == (1, 2)
    assert store.lookup([1, 2]) is None


def test_a_later_snapshot_of_the_same_tokens_replaces_the_earlier():
    store = PrefixStore()
    first, second = fake([5, 6]), fake([5, 6])
    store.put(first)
    store.put(second)
    assert len(store) == 1 and store.lookup([5, 6, 7]) is second


@pytest.mark.parametrize("begin, end, interval, ends", [
    (0, 20, 8, [8, 16, 20]),
    (0, 16, 8, [8, 16]),  # a prompt of whole intervals ends on a boundary: a snapshot there too
    (5, 20, 8, [8, 16, 20]),  # after a hit at 5 (a finish snapshot) the next chunk ends at 8
    (16, 17, 8, [17]),
    (0, 20, None, [20]),
    (0, 3, 1, [1, 2, 3]),
])
def test_chunk_ends(begin, end, interval, ends):
    assert chunk_ends(begin, end, interval) == ends


@pytest.mark.parametrize("interval", [0, -8, 2.0])
def test_a_bad_interval_is_refused(interval):
    with pytest.raises(ValueError, match="snapshot_interval"):
        chunk_ends(0, 20, interval)


def test_take_snapshot_refuses_a_key_that_is_not_the_cache(models):
    cache = models.target.new_cache()
    models.target.forward(torch.tensor(PROMPT[:5]), cache)
    with pytest.raises(ValueError, match="frontier"):
        take_snapshot(PROMPT[:4], cache, None)


# -- what the loops leave in the store ---------------------------------------------------------------


def test_prefill_snapshots_are_the_chunk_end_states(models):
    """Plain decoding, interval 8, prompt of 21: snapshots at 8 and 16 hold exactly the state of chunks
    [0, 8) and [8, 16) run by hand, and the finish snapshot holds the prompt and every output token but the last."""
    store = PrefixStore()
    result = generate(models.target, PROMPT, GREEDY, snapshot_interval=8, store=store)
    f_finish = len(PROMPT) + len(result.token_ids) - 1
    assert sorted(s.length for s in store.snapshots.values()) == [8, 16, f_finish]
    cache = models.target.new_cache()
    for begin, end in ((0, 8), (8, 16)):
        models.target.forward(torch.tensor(PROMPT[begin:end]), cache)
        snapshot = store.snapshots[tuple(PROMPT[:end])]
        assert snapshot.proposer_state is None and caches_equal(snapshot.cache, cache)
    assert store.snapshots[tuple(PROMPT + result.token_ids[:-1])].cache.length == f_finish


def test_without_a_store_nothing_changes_and_the_chunking_keeps_the_tokens(models):
    plain = generate(models.target, PROMPT, GREEDY)
    assert generate(models.target, PROMPT, GREEDY, snapshot_interval=8).token_ids == plain.token_ids
    spec = speculative_generate(models.target, MTPProposer(models.mtp), PROMPT, GREEDY, 3)
    chunked = speculative_generate(models.target, MTPProposer(models.mtp), PROMPT, GREEDY, 3, snapshot_interval=8)
    assert spec.token_ids == chunked.token_ids == plain.token_ids


def test_snapshot_at_finish_is_the_committed_state_after_a_rejected_verify(models):
    """Drafts right in slot 1 and wrong after it: every verify rejects, the loop replays [t0, y_1] and
    emits y_1 and the correction. A request ends on a rejecting verify only at a stop id (a length
    finish drafts exactly what is left), here the correction of step j/2. The finish snapshot must be
    the committed cache, bit for bit the forwards over [t0, kept drafts] of every step after the
    prefill, not the verify's (which also holds the rejected rows)."""
    truth = generate(models.target, PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)).token_ids
    j = next(j for j in range(6, 30, 2) if truth[j] not in truth[:j])  # a correction token, first seen there
    store = PrefixStore()
    result = speculative_generate(models.target, Scripted(PROMPT + truth, right=1), PROMPT,
                                  SamplingParams(max_tokens=30, temperature=0), 3, stop_token_ids=[truth[j]],
                                  store=store)
    assert result.finish_reason == "stop" and result.token_ids == truth[:j + 1]
    last = result.steps[-1]
    assert (len(last.draft_tokens), last.num_accepted) == (3, 1)  # the final verify rejected two drafts
    (snapshot,) = store.snapshots.values()
    f = len(PROMPT) + j
    assert snapshot.tokens == tuple(PROMPT + truth[:j]) and snapshot.cache.length == f
    committed = models.target.new_cache()
    models.target.forward(torch.tensor(PROMPT), committed)
    anchor = result.token_ids[0]
    for step in result.steps:
        models.target.forward(torch.tensor([anchor] + step.draft_tokens[:step.num_accepted]), committed)
        anchor = step.emitted[-1]
    assert caches_equal(snapshot.cache, committed)


def test_a_stop_id_inside_a_step_keys_the_snapshot_by_the_cache_not_the_output(models):
    """All drafts right (k = 3, 4 tokens a step): a stop id in the middle of step 2 cuts the output, but
    the cache holds every token the verify kept, and the finish snapshot's key says so."""
    truth = generate(models.target, PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)).token_ids
    j = next(j for j in (5, 6, 7) if truth[j] not in truth[:j])  # the token at j stops the request
    params = SamplingParams(max_tokens=20, temperature=0)
    store = PrefixStore()
    result = speculative_generate(models.target, Scripted(PROMPT + truth), PROMPT, params, 3, stop_token_ids=[truth[j]],
                                  store=store)
    assert result.finish_reason == "stop" and result.token_ids == truth[:j + 1]
    (snapshot,) = store.snapshots.values()
    assert snapshot.tokens == tuple(PROMPT + truth[:8]) and snapshot.cache.length == len(PROMPT) + 8


# -- each proposer's state -----------------------------------------------------------------------------


def test_dflash_snapshot_keeps_the_last_w_minus_1_context_rows_and_restore_rebuilds_the_ring(models):
    """A run long enough to wrap the ring (84 slots): the prefill snapshot at 8 keeps rows 0..7 (f < W),
    the finish snapshot rows f-19..f-1; a fresh proposer restored from it reads at f what the live one does."""
    live = DFlashProposer(models.draft)
    store = PrefixStore()
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    result = speculative_generate(models.target, live, PROMPT, params, 3, snapshot_interval=8, store=store)
    early = store.snapshots[tuple(PROMPT[:8])].proposer_state
    assert isinstance(early, ContextWindow) and early.positions.tolist() == list(range(8))
    f = len(PROMPT) + len(result.token_ids) - 1
    assert f > WINDOW + live.ring.margin
    state = store.snapshots[tuple(PROMPT + result.token_ids[:-1])].proposer_state
    assert state.positions.tolist() == list(range(f - WINDOW + 1, f)) and state.rows.shape == (WINDOW - 1, 40)
    restored = DFlashProposer(models.draft)
    restored.restore(state)
    for ring in ("ring", "window"):
        (p_live, r_live), (p_back, r_back) = getattr(live, ring).read(f), getattr(restored, ring).read(f)
        assert torch.equal(p_live, p_back) and torch.equal(r_live, r_back), ring


def test_mtp_snapshot_restore_and_a_chunked_prefill(models):
    """After a prefill in chunks [0, 8), [8, 16), [16, 21) the MTP cache holds pairs 0..19 as after one chunk
    (the pair at each boundary is added by the next chunk's observe); a restore copies cache and h_{f-1}."""
    whole, chunked = MTPProposer(models.mtp), MTPProposer(models.mtp)
    out = models.target.forward(torch.tensor(PROMPT))
    whole.observe(PROMPT, 0, out, len(PROMPT))
    for begin, end in ((0, 8), (8, 16), (16, 21)):  # the same target rows, handed over a chunk at a time
        rows = TargetOutput(out.logits[begin:end], out.hidden[begin:end], tuple(t[begin:end] for t in out.taps))
        chunked.observe(PROMPT[begin:end], begin, rows, end - begin)
    assert chunked.cache.length == whole.cache.length == len(PROMPT) - 1
    torch.testing.assert_close(chunked.cache.kv.keys, whole.cache.kv.keys, rtol=1e-5, atol=1e-5)
    state = chunked.snapshot(len(PROMPT))
    restored = MTPProposer(models.mtp)
    restored.restore(state)
    assert torch.equal(restored.cache.kv.keys, chunked.cache.kv.keys)
    assert torch.equal(restored.cache.kv.values, chunked.cache.kv.values)
    assert torch.equal(restored.pending_hidden, chunked.pending_hidden)
    restored.cache.truncate(3)  # the restored state is a copy: the snapshot is not touched
    assert state.cache.length == len(PROMPT) - 1


def test_ngram_and_the_default_proposer_state(models):
    ngram = NgramProposer()
    ngram.observe(PROMPT, 0, None, len(PROMPT))
    fresh = NgramProposer()
    fresh.restore(ngram.snapshot(10))
    assert fresh.history == PROMPT[:10]
    assert Scripted(PROMPT).snapshot(4) is None


@pytest.mark.parametrize("proposer", ["dflash", "mtp"])
def test_a_snapshot_of_another_kind_is_refused(models, proposer):
    new = DFlashProposer(models.draft) if proposer == "dflash" else MTPProposer(models.mtp)
    with pytest.raises(ValueError, match="another kind of proposer"):
        new.restore(None)
