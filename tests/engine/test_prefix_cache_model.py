"""fast/engine/prefix_cache.py under a Hypothesis state machine of arrivals, hits, finishes, aborts, snapshots and
evictions, against a model that is a dict: snapshot token tuples in least-recently-used order.

The model predicts every hit (the longest kept key that is a prefix of the prompt, shorter than it), every
eviction (the oldest key: by a full set of snapshot slots, by an explicit eviction, or by a shortage of pages,
which drops a prefix of the order) and the order itself. After every rule the pages are checked against their
holders: each page's reference count equals the running requests holding it plus the cache's holders, the free
list holds exactly the pages nobody holds, and no page is both. Tokens come from a three-letter alphabet with
two-token pages, so prompts share prefixes, tails and whole pages all the time.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dflash2.fast.engine.prefix_cache import PrefixCache
from dflash2.fast.engine.scheduler import PageAllocator, pages_for

PAGE = 2
NUM_PAGES = 40
SLOTS = 3
tokens_st = st.lists(st.integers(1, 3), min_size=2, max_size=9)


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(mtp=st.booleans())
    def start(self, mtp):
        self.pages = PageAllocator(NUM_PAGES)
        self.cache = PrefixCache(self.pages, page_size=PAGE, num_slots=SLOTS, snapshot_interval=PAGE,
                                 rewrites_last_row=mtp)
        self.mtp = mtp
        self.model: OrderedDict[tuple[int, ...], None] = OrderedDict()  # oldest first
        self.running: list[tuple[list[int], list[int]]] = []  # (tokens, pages) of each running request

    # ---- the model ------------------------------------------------------------------------------

    def expected_hit(self, prompt: list[int]) -> int:
        lengths = [len(key) for key in self.model if len(key) < len(prompt) and tuple(prompt[:len(key)]) == key]
        return max(lengths, default=0)

    def kept_keys(self) -> list[tuple[int, ...]]:
        # a node's key is its page's tokens (and, with an MTP head, the next page's first token)
        return [tuple(tok for node in s.node.path() for tok in node.tokens[:PAGE]) + s.tail for s in self.cache.lru]

    # ---- rules ----------------------------------------------------------------------------------

    @rule(prompt=tokens_st, extra=st.integers(0, 4))
    def arrive(self, prompt, extra):
        """Admission: the hit the model predicts; shared pages, a private copy of the boundary page, new pages."""
        hit = self.cache.lookup(prompt)
        assert (hit.length if hit else 0) == self.expected_hit(prompt)
        shared = hit.pages[:hit.num_shared] if hit else []
        if hit:
            keep_from = hit.length - 1 if self.mtp else hit.length
            assert hit.num_shared == keep_from // PAGE and len(hit.pages) == pages_for(hit.length, PAGE)
        need = pages_for(len(prompt) + extra, PAGE) - len(shared)
        if need > self.pages.available + self.cache.freeable_pages(hit):
            return  # it would wait: nothing is evicted for it
        if hit:
            self.cache.use(hit, len(prompt))
            self.model.move_to_end(tuple(prompt[:hit.length]))
        self.cache.evict_until(need)
        assert self.pages.available >= need
        self.sync_after_page_eviction()
        for page in shared:
            self.pages.share(page)
        self.pages.reserve(need)
        self.running.append((list(prompt) + [1] * extra, shared + self.pages.take_reserved(need)))
        self.cache.unpin_all()

    @precondition(lambda self: self.model)
    @rule(which=st.integers(0, 100), more=st.lists(st.integers(1, 3), max_size=4), extra=st.integers(0, 4))
    def continue_a_conversation(self, which, more, extra):
        """An arrival that extends a kept snapshot's tokens (the next turn of a chat), by zero tokens or more."""
        key = list(self.model)[which % len(self.model)]
        self.arrive(list(key) + more, extra)

    def sync_after_page_eviction(self):
        """Page pressure evicts the oldest snapshots first: the cache keeps a suffix of the model's order."""
        before, kept = list(self.model), self.kept_keys()
        assert kept == before[len(before) - len(kept):]
        for key in before[:len(before) - len(kept)]:
            del self.model[key]

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100), cut=st.integers(1, 12))
    def snapshot(self, which, cut):
        """A snapshot of a running request's first ``length`` tokens (a prefill boundary or a finish)."""
        tokens, pages = self.running[which % len(self.running)]
        key = tuple(tokens[:max(1, min(cut, len(tokens)))])
        if self.cache.find(key) is not None:
            self.cache.lru.move_to_end(self.cache.find(key))
            self.model.move_to_end(key)
            return
        slot = self.cache.take_slot()
        assert slot is not None
        if len(self.model) == SLOTS:
            self.model.popitem(last=False)
        self.cache.insert(key, pages, slot)
        self.model[key] = None

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def finish(self, which):
        """A finish or an abort: the request's references go (its reservation was all taken at admission)."""
        _, pages = self.running.pop(which % len(self.running))
        self.pages.release(pages, 0)

    @rule()
    def evict(self):
        evicted = self.cache.evict_one()
        assert evicted == bool(self.model)
        if evicted:
            self.model.popitem(last=False)

    # ---- invariants -----------------------------------------------------------------------------

    @invariant()
    def the_order_is_the_models(self):
        assert self.kept_keys() == list(self.model)
        assert self.cache.num_snapshots + len(self.cache.free_slots) == SLOTS

    @invariant()
    def every_page_is_free_or_held_as_counted(self):
        assert self.cache.num_pages == len(set(self.cache.held_pages()))  # the count the server reads every step
        holders = Counter(p for _, pages in self.running for p in pages) + Counter(self.cache.held_pages())
        free = list(self.pages.free_pages)
        assert len(set(free)) == len(free) and not set(free) & set(holders)
        assert len(free) + len(holders) == NUM_PAGES
        assert all(self.pages.refs[p] == n for p, n in holders.items())
        for snap in self.cache.lru:
            assert len(snap.pages()) == pages_for(snap.length, PAGE)

    def teardown(self):
        for _, pages in self.running:
            self.pages.release(pages, 0)
        self.cache.clear()
        assert len(self.pages.free_pages) == NUM_PAGES and self.pages.reserved == 0


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_prefix_cache_against_a_dict = PrefixCacheMachine.TestCase


def test_with_an_mtp_head_a_page_is_shared_only_by_prefixes_that_continue_alike():
    """A page's last MTP row pairs its last position with the next token, so with an MTP head the trie keys a page
    by its tokens and that next token: a prompt that continues differently resumes from the snapshot whose tail
    (a private copy) ends there instead of sharing a page whose last row belongs to another continuation."""
    first_page = [1, 2] * 8  # 16 tokens: one page
    for mtp in (False, True):
        pages = PageAllocator(8)
        cache = PrefixCache(pages, page_size=16, num_slots=4, snapshot_interval=16, rewrites_last_row=mtp)
        pages.reserve(2)
        held = pages.take_reserved(2)  # the first request's pages
        cache.insert(first_page, held, cache.take_slot())  # its prefill boundary at 16
        cache.insert(first_page + [5, 5, 5, 5], held, cache.take_slot())  # its finish at 20
        hit = cache.lookup(first_page + [6, 6, 6])
        assert hit.length == 16
        if mtp:  # page 0's key is its tokens and a 5: not this prompt's; the 16-token snapshot's tail is page 0
            assert hit.num_shared == 0 and hit.copy_page == held[0]
        else:
            assert hit.num_shared == 1 and hit.copy_page is None
        again = cache.lookup(first_page + [5, 5, 5, 5, 1])
        assert again.length == 20 and again.num_shared == 1 and again.copy_page == held[1]
        pages.release(held, 0)
        cache.clear()
        assert len(pages.free_pages) == 8
