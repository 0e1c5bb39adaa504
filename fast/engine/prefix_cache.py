"""The prefix cache for hybrid targets: snapshot-anchored KV pages over token ids (host side, no tensors).

Why snapshots anchor it. A full-attention layer can resume after any cached prefix: its K/V rows are
there. A Gated DeltaNet layer cannot: its state after token b-1 is one recurrent matrix (and conv taps)
that folds in every earlier token, so a prefix is only resumable where that state was kept. The unit
of the cache is therefore a *snapshot* at position b (tokens 0..b-1 through the target):

- the target's GDN state after token b-1 and the proposer's slot state (DFlash: its ``dflash_window``
  of context rows; MTP: the pending hidden row h_{b-1}), copied into one of ``num_slots`` snapshot
  slots (``fast/engine/snapshots.py`` moves the tensors);
- the KV pages of positions 0..b-1 (the full-attention layers' and the MTP layer's K/V).

Snapshots are taken while requests prefill, at every multiple of ``snapshot_interval`` (a multiple of
the page size: the scheduler ends prefill chunks there, so the snapshot is the chunk's own end state,
nothing recomputed), and when a request finishes with its state at its frontier (its last committed
token is the anchor f, not yet through the target: a snapshot at f holds the whole conversation so
far, so the next turn of a chat hits it).

Layout: a trie over full pages. A node stands for a page-aligned prefix: its parent's prefix plus one
page of P tokens, compared as exact tuples (no hash collisions to reason about), and holds that page.
A snapshot at b hangs on the node of its ``b // P`` full pages (``(b - 1) // P`` with an MTP head, below)
with its tail, the tokens past them, whose page it owns. A node keeps its page while any snapshot lies at or below it;
pages that no snapshot covers are useless for a hybrid target (no state to resume from) and are never
kept.

With an MTP head (``rewrites_last_row``) a page's last row is the MTP pair (h_p, t_{p+1}), which reads
the first token of the next page: a node's key is then its page's tokens and that next token, so only
prefixes that continue alike share it, and a snapshot's last page is always its tail (1 to P tokens:
the pair at b-1 reads token b, beyond the snapshot, and is rewritten by the resumed prefill).

A hit: the snapshot with the longest prefix of the prompt, at b <= len(prompt) - 1 (one token always
runs through the target, for the next token's logits). The request shares the trie's pages of its path
and gets a private copy of the snapshot's tail page (positions up to b-1 past the full pages, which its
prefill extends, and for MTP rewrites at b-1); it writes only positions >= b (and, for MTP, b-1) into
pages of its own, so shared pages are never written.

Pages are refcounted by the allocator (``scheduler.PageAllocator``): one reference per running request
that holds the page and one per cache holder (a node, a snapshot's tail). Eviction is LRU over
snapshots not pinned by a restore in flight: evicting one drops its tail page and its reference on every
node of its path; a node left with no snapshot drops its page, which returns to the free list once no
running request holds it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    """A page-aligned prefix: the parent's tokens plus ``tokens`` (one page), stored in ``page``."""

    parent: _Node | None
    tokens: tuple[int, ...]  # the key: the page's tokens (and, with an MTP head, the next page's first)
    page: int  # -1 for the root (the empty prefix)
    depth: int  # full pages from the root
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    snapshots: dict[tuple[int, ...], Snapshot] = field(default_factory=dict)  # tail tokens -> snapshot
    refs: int = 0  # snapshots at or below this node

    def path(self) -> list[_Node]:
        """The nodes from the first page to this one (the root excluded)."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


@dataclass(eq=False)
class Snapshot:
    """A resumable prefix of ``length`` tokens: the state in snapshot slot ``slot`` and the pages below it."""

    node: _Node  # the last shared page of the prefix (the root when there is none)
    tail: tuple[int, ...]  # the tokens past the node's pages (length mod P of them; 1 to P with an MTP head)
    tail_page: int  # the page holding the tail (-1: no tail)
    slot: int  # snapshot slot index, 0 .. num_slots - 1
    length: int

    def pages(self) -> list[int]:
        """The pages of positions 0..length-1, in order (the tail's last)."""
        pages = [n.page for n in self.node.path()]
        return pages + [self.tail_page] if self.tail else pages


@dataclass(frozen=True)
class PrefixHit:
    """How a prompt resumes from ``snapshot``: ``pages[:num_shared]`` shared (the trie's), ``pages[num_shared]`` (the
    tail's, if any) copied."""

    snapshot: Snapshot
    pages: list[int]  # the snapshot's pages, covering positions 0..length-1
    num_shared: int

    @property
    def length(self) -> int:
        return self.snapshot.length

    @property
    def copy_page(self) -> int | None:
        """The page to copy into a private one (it holds positions the request's prefill rewrites or extends)."""
        return self.pages[self.num_shared] if self.num_shared < len(self.pages) else None


@dataclass
class PrefixStats:
    """Counters, in vLLM's units: prompt tokens looked up, of those found cached, snapshots evicted."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    snapshots: int = 0  # snapshots taken


class PrefixCache:
    """See the module docstring. ``pages``: the scheduler's allocator (``share`` / ``drop`` refcounts);
    ``rewrites_last_row``: the proposer rewrites row b-1 on a resume at b (MTP), so that page is copied."""

    def __init__(self, pages, *, page_size: int, num_slots: int, snapshot_interval: int,
                 rewrites_last_row: bool = False):
        if snapshot_interval < page_size or snapshot_interval % page_size:
            raise ValueError(f"snapshot_interval={snapshot_interval}: expected a multiple of page_size={page_size}")
        self.pages, self.page_size, self.num_slots = pages, page_size, num_slots
        self.snapshot_interval = snapshot_interval
        self.rewrites_last_row = rewrites_last_row
        self.root = _Node(None, (), -1, 0)
        self.free_slots: list[int] = list(range(num_slots))[::-1]
        self.lru: OrderedDict[Snapshot, None] = OrderedDict()  # oldest first
        self.pinned: set[Snapshot] = set()  # restores planned and not yet run
        # the cache's references per page (a node's page may also be another snapshot's tail), kept as it goes:
        # the server reads the count every step
        self._refs: Counter[int] = Counter()
        self.stats = PrefixStats()

    # ---- lookups --------------------------------------------------------------------------------

    @property
    def _extra(self) -> int:
        """Tokens of the next page in a node's key: 1 with an MTP head (its page's last row reads it), else 0."""
        return int(self.rewrites_last_row)

    def _num_shared(self, length: int) -> int:
        """Pages of a ``length``-token prefix that are trie nodes: those whose key lies within it."""
        return max(0, length - self._extra) // self.page_size

    def _walk(self, tokens: Sequence[int], limit: int):
        """The nodes along ``tokens`` whose keys lie within its first ``limit`` tokens, from the root."""
        node, p = self.root, self.page_size
        yield node
        while (node.depth + 1) * p + self._extra <= limit:
            node = node.children.get(tuple(tokens[node.depth * p:(node.depth + 1) * p + self._extra]))
            if node is None:
                return
            yield node

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest snapshot a prompt can resume from (b <= len(prompt) - 1), or None. Touches nothing."""
        limit, best = len(prompt) - 1, None
        for node in self._walk(prompt, limit):
            start = node.depth * self.page_size
            for tail, snap in node.snapshots.items():
                if start + len(tail) <= limit and tuple(prompt[start:start + len(tail)]) == tail:
                    if best is None or snap.length > best.length:
                        best = snap
        if best is None:
            return None
        return PrefixHit(best, best.pages(), best.node.depth)

    def find(self, tokens: Sequence[int]) -> Snapshot | None:
        """The snapshot of exactly ``tokens``, if one is kept."""
        node = None
        for node in self._walk(tokens, len(tokens)):
            pass
        if node is None or node.depth != self._num_shared(len(tokens)):
            return None
        return node.snapshots.get(tuple(tokens[node.depth * self.page_size:]))

    # ---- admission: the caller's side of a hit ------------------------------------------------

    def use(self, hit: PrefixHit, prompt_len: int) -> None:
        """A request was admitted on ``hit``: count it, mark the snapshot recently used and pin it until
        :meth:`unpin_all` (its state and copied page are read when the step runs)."""
        self.lru.move_to_end(hit.snapshot)
        self.pinned.add(hit.snapshot)
        self.stats.hits += hit.length
        self.stats.queries += prompt_len

    def count_miss(self, prompt_len: int) -> None:
        self.stats.queries += prompt_len

    def unpin_all(self) -> None:
        self.pinned.clear()

    # ---- snapshots in -------------------------------------------------------------------------

    def take_slot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used snapshot if none is free; None when
        every snapshot is pinned (or there are no slots)."""
        if not self.free_slots and not self.evict_one():
            return None
        return self.free_slots.pop()

    def insert(self, tokens: Sequence[int], pages: Sequence[int], slot: int) -> Snapshot:
        """Keep a snapshot of ``tokens`` (b = len(tokens)) in snapshot ``slot``: ``pages`` are the
        request's pages of positions 0..b-1 (at least ceil(b / P)). Full pages already in the trie are
        not taken again (the request's own copy is freed with the request)."""
        p, length = self.page_size, len(tokens)
        assert self.find(tokens) is None, "a snapshot of these tokens is kept already"
        assert len(pages) * p >= length, f"{len(pages)} pages for a {length}-token snapshot"
        node = self.root
        for i in range(self._num_shared(length)):
            key = tuple(tokens[i * p:(i + 1) * p + self._extra])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key, pages[i], i + 1)
                self._hold(pages[i])
            node = child
        tail = tuple(tokens[node.depth * p:])
        tail_page = -1
        if tail:
            tail_page = pages[node.depth]
            self._hold(tail_page)
        snap = Snapshot(node, tail, tail_page, slot, length)
        node.snapshots[tail] = snap
        for n in node.path():
            n.refs += 1
        self.lru[snap] = None
        self.stats.snapshots += 1
        return snap

    def release_slot(self, slot: int) -> None:
        """Give back a slot from :meth:`take_slot` that was not used."""
        self.free_slots.append(slot)

    # ---- eviction -----------------------------------------------------------------------------

    def evict_one(self) -> bool:
        """Drop the least recently used unpinned snapshot; False if there is none."""
        victim = next((s for s in self.lru if s not in self.pinned), None)
        if victim is None:
            return False
        self._drop(victim)
        self.stats.evictions += 1
        return True

    def evict_until(self, pages_needed: int) -> None:
        """Evict until ``pages_needed`` pages are available or nothing evictable is left."""
        while self.pages.available < pages_needed and self.evict_one():
            pass

    def freeable_pages(self, keep: PrefixHit | None = None) -> int:
        """Pages that evicting every unpinned snapshot (but ``keep``'s) would return to the free list: those
        no running request holds."""
        kept = {page for snap in self.pinned | ({keep.snapshot} if keep is not None else set())
                for page in snap.pages()}
        counts = Counter(self.held_pages())
        return sum(1 for page, n in counts.items() if page not in kept and self.pages.refs[page] == n)

    def clear(self) -> None:
        """Drop every unpinned snapshot (no evictions counted)."""
        for snap in [s for s in self.lru if s not in self.pinned]:
            self._drop(snap)

    def _drop(self, snap: Snapshot) -> None:
        del self.lru[snap]
        del snap.node.snapshots[snap.tail]
        if snap.tail_page >= 0:
            self._release(snap.tail_page)
        for node in reversed(snap.node.path()):
            node.refs -= 1
            if node.refs == 0 and not node.children and not node.snapshots:
                del node.parent.children[node.tokens]
                self._release(node.page)
        self.free_slots.append(snap.slot)

    # ---- accounting ---------------------------------------------------------------------------

    def _hold(self, page: int) -> None:
        self.pages.share(page)
        self._refs[page] += 1

    def _release(self, page: int) -> None:
        self.pages.drop(page)
        self._refs[page] -= 1
        if not self._refs[page]:
            del self._refs[page]

    @property
    def num_pages(self) -> int:
        """Distinct pages the cache holds."""
        return len(self._refs)

    @property
    def num_snapshots(self) -> int:
        return len(self.lru)

    def held_pages(self) -> list[int]:
        """Every page reference the cache holds (nodes' pages and tails), for the leak check (a walk of the whole
        trie: ``num_pages`` counts the distinct ones without a walk)."""
        held, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.page >= 0:
                held.append(node.page)
            held += [s.tail_page for s in node.snapshots.values() if s.tail_page >= 0]
            stack += node.children.values()
        return held
