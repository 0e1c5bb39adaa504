"""Finish snapshots under overlap scheduling: a periodic checkpoint of each running request's state.

A request that ends is snapshotted at its frontier so that the next turn of a conversation resumes after all of
it (``engine.py``). With overlap scheduling that state is often gone: the step after step N is launched before N's
tokens are read, so when N ends a request at a stop token, the next step has already moved its state on.

So each running slot owns one spare snapshot slot, its checkpoint. When the engine consents to launch a step
ahead, each request ``period`` or more tokens past its last checkpoint has its state copied there. The copy is
queued after the steps already launched and before the one being launched, so it holds the state at the end of
the last step queued: at the request's current anchor when no step is in flight, else at the frontier the step in
flight leaves, which the host learns when it commits that step (``resolve``). A request that ends with its state
moved on hands its checkpoint to the prefix cache as a snapshot (``hand_over``: the snapshot takes the checkpoint's
slot and the request slot takes a free one, so nothing is copied); the next turn then resumes at most ``period``
tokens and one step before the end of the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .prefix_cache import PrefixCache
from .scheduler import Req
from .snapshots import StateSnapshots

CHECKPOINT_TOKENS = 64  # committed tokens between a request's checkpoints (a state copy each)


@dataclass
class _Checkpoint:
    frontier: int | None  # tokens through the target when it was taken; None: the step in flight will tell
    index: int  # the snapshot slot holding it


class Checkpoints:
    """Checkpoint slots ``first_index .. first_index + num_slots - 1`` of ``snapshots``, one per request slot."""

    def __init__(self, snapshots: StateSnapshots, first_index: int, num_slots: int, period: int = CHECKPOINT_TOKENS):
        self.snapshots, self.period = snapshots, period
        self.index = list(range(first_index, first_index + num_slots))  # request slot -> its checkpoint slot
        self.latest: dict[int, _Checkpoint] = {}  # request id -> its latest checkpoint
        self.taken = 0  # checkpoints copied (a counter for tests and reports)

    def due(self, req: Req) -> bool:
        last = self.latest.get(req.rid)
        if last is None:
            return True
        return last.frontier is not None and req.anchor_position - last.frontier >= self.period

    def take(self, reqs: Sequence[Req], step_in_flight: bool) -> None:
        """Copy the state of each request that is due (call where the copy lands between two steps)."""
        due = [r for r in reqs if self.due(r)]
        if not due:
            return
        self.snapshots.save([r.slot for r in due], [self.index[r.slot] for r in due])
        for req in due:
            self.latest[req.rid] = _Checkpoint(None if step_in_flight else req.anchor_position, self.index[req.slot])
        self.taken += len(due)

    def resolve(self, req: Req, at_output: bool) -> None:
        """The step in flight when ``req``'s latest checkpoint was taken has been committed: its frontier is the
        request's anchor now, if the state is at its output (``at_output``: no stop cut inside the step's tokens),
        else the checkpoint is useless."""
        last = self.latest.get(req.rid)
        if last is not None and last.frontier is None:
            if at_output:
                last.frontier = req.anchor_position
            else:
                del self.latest[req.rid]

    def hand_over(self, req: Req, cache: PrefixCache) -> bool:
        """Keep ``req``'s latest checkpoint as a prefix-cache snapshot (call before its pages go back)."""
        last = self.latest.get(req.rid)
        if last is None or last.frontier is None or last.frontier < 1:
            return False
        tokens = (req.prompt_ids + req.output_ids)[:last.frontier]
        kept = cache.find(tokens)
        if kept is not None:
            cache.lru.move_to_end(kept)
            return False
        spare = cache.take_slot()
        if spare is None:
            return False
        cache.insert(tokens, req.pages, last.index)  # the checkpoint's slot becomes the snapshot's
        self.index[req.slot] = spare  # and the request slot takes the spare for its next checkpoints
        del self.latest[req.rid]
        return True

    def forget(self, req: Req) -> None:
        self.latest.pop(req.rid, None)
