"""One speculative step over device tensors: propose, the target over [anchor, drafts], verify, commit, observe
(twin of ``reference/speculative/loop.verify_step``, for B requests at once).

    proposal = proposer.propose(anchor_tokens, anchors, slots, block_tables, k, st)     k drafts per request
    out      = target.forward(batch)              the rows [anchor, y_1..y_k] of every request (is_verify)
    result   = verifier(logits [B, k+1, V], proposal, k_b, st, anchors)          num_accepted, emitted
    commit_verify(pools, batch, num_accepted + 1)                the GDN state after the last kept row
    proposer.observe(batch, out, num_accepted + 1)                    every row, acceptance known

Rejected rows' K/V stays in the request's own pages past its committed context: never read (the attention
reads up to ``context_lens``) and overwritten by the next step's rows at the same positions, so nothing is
freed or copied on a rejection. The DFlash ring is the same story.

:class:`SpeculativeStep` holds the pieces; the engine's eager verify (``engine/runner.py`` over
``engine/eager_step.py``) and its captured step (``engine/graphs/graph_step.py``) both run them. The captured step runs :meth:`SpeculativeStep.verify_uniform`,
where a proposer that ``observes_taps_only`` observes on a side stream from the target's last tapped layer on,
joined at the end (``fast/model/side_stream.py``): the same values as observing after the commit (its inputs
are the taps and the batch, its outputs the proposer's own state, read next step).

``verifier`` is :func:`~.verify.verify_ragged`; a benchmark may wrap it (``bench/simulated.py``), which no
serving path does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.sampling.sampler import SamplingTensors
from ..model.batch import ForwardBatch
from ..model.pools import CachePools
from ..model.side_stream import SideStream
from ..model.target import FastOutput, FastTarget
from .commit import commit_verify
from .proposer import DraftProposal, Proposer
from .verify import Verifier, verify_ragged


class SpeculativeStep:
    """The target, its pools, a proposer and a verifier: the speculative step's pieces (module docstring)."""

    def __init__(self, target: FastTarget, pools: CachePools, proposer: Proposer, *, side_stream: bool = True,
                 verifier: Verifier = verify_ragged):
        self.target, self.pools, self.proposer, self.verifier = target, pools, proposer, verifier
        self.side = SideStream(pools.device, enabled=side_stream)
        # tensor parallelism: called with (batch, num_rows_kept) before each commit (TPWorkers.commit queues it
        # for the other ranks' pools); None at tp=1
        self.before_commit: Callable[[ForwardBatch, Tensor], None] | None = None

    def _commit(self, batch: ForwardBatch, num_rows_kept: Tensor, meta) -> None:
        if self.before_commit is not None:
            self.before_commit(batch, num_rows_kept)
        commit_verify(self.pools, batch, num_rows_kept, meta)

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor | None,
                k: int, st: SamplingTensors) -> DraftProposal:
        """k drafts per request (``block_tables`` only for a proposer that reads them, else None); k = 0: none."""
        if k == 0:
            return DraftProposal.deterministic(torch.zeros(anchor_tokens.shape[0], 0, dtype=torch.long,
                                                           device=anchor_tokens.device))
        return self.proposer.propose(anchor_tokens, anchor_positions, slots,
                                     block_tables if self.proposer.reads_block_tables else None, k, st)

    def verify_uniform(self, batch: ForwardBatch, proposal: DraftProposal, st: SamplingTensors,
                       anchors: Tensor, limits: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The rest of a step whose B requests all run k = ``proposal.tokens.shape[1]`` drafts over ``batch``
        (k + 1 rows each): forward, verify, commit, observe. Returns ``(num_accepted [B], emitted [B, k + 1])``.
        ``limits [B]`` (a device tensor; None: k each): request b verifies its first limits[b] drafts only, as a
        step of that many would (a request near its end); its rows past them are computed and never committed.

        A step of no drafts (k = 0, a plain step of an adaptive depth) may run ``batch`` as a decode
        (``is_verify`` False): every row is committed, so the forward updates the GDN state in place and there is
        nothing to commit, as in plain decoding; the verify still draws the token with the speculative keys."""
        num_seqs, k = proposal.tokens.shape
        early = self.proposer.observes_taps_only
        on_taps = (lambda taps: self.side.fork(lambda: self.proposer.observe_taps(batch, taps))) if early else None
        try:
            out = self.target.forward(batch, self.pools, on_taps=on_taps)
            logits = out.logits.view(num_seqs, k + 1, -1)
            result = self.verifier(logits, proposal, [k] * num_seqs if limits is None else limits, st, anchors)
            if batch.is_verify:  # a step of no drafts ran as a decode: its GDN state is already the committed one
                self._commit(batch, result.num_accepted + 1, out.meta)
            if not early:
                self.proposer.observe(batch, out, result.num_accepted + 1)
        finally:
            self.side.join()  # before out (the taps) can be freed; also on an error, so no fork stays open
        return result.num_accepted, result.emitted

    def commit_and_observe(self, batch: ForwardBatch, out: FastOutput, num_accepted: Tensor) -> None:
        """The eager step's end: the GDN commit, then the proposer sees every row with what was committed."""
        num_committed = num_accepted + 1
        if batch.is_verify:
            self._commit(batch, num_committed, out.meta)
        self.proposer.observe(batch, out, num_committed)
