"""The model runner: a scheduler plan in, ForwardBatch tensors, the forwards, and committed tokens out.

Three kinds of step (``Scheduler.schedule``):

- prefill: chunks of prompts, one row per prompt token; the proposer sees every row (DFlash writes
  its ring, MTP its pairs); a chunk that completes its prompt samples the first output token at
  position n = len(prompt) with the key (seed, n, SAMPLE, 0);
- plain decode: one row per request, the anchor at s; the next token is sampled at s + 1 with
  (seed, s + 1, SAMPLE, 0);
- verify: ``propose`` k drafts per request (the batch's largest k; a request near its end uses the
  first k_b, which is what it would have drafted alone: every slot's draw is keyed by its own slot)
  -> one target forward over [anchor, y_1..y_kb] per request (``is_verify``) -> batched verify
  (``sampler.verify_ragged``) -> ``commit_verify`` keeps the GDN state after row num_accepted -> the
  proposer sees all k_b + 1 rows with num_accepted + 1 committed.

Rejected rows' K/V stays in the request's own pages past its committed context: never read (the
attention reads up to ``context_lens``) and overwritten by the next step's rows at the same
positions, so nothing is freed or copied on a rejection. The DFlash ring is the same story.

Tensors are built on the host from the plan (per-request bookkeeping between steps) and copied to
the device once per step; the one device-to-host sync per step reads the committed tokens.

Logprobs (optional, off by default): a step given ``top_logprobs`` (one entry per plan request: None
for a request that wants none, else how many alternatives) also leaves in ``self.logprobs``, per
plan request, a :class:`TokenLogprob` for each token it committed (before any stop cut), read from
the target's filtered distribution at that token's row (``fast/engine/logprobs.py``): the prefill
row that completes a prompt, the decode row, or verify rows 0..num_accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.request.trace import StepRecord

from ..kernels.sampling.sampler import HostSummary, SamplingTensors
from ..model.batch import ForwardBatch
from ..model.capture import graph_cut
from ..speculative.commit import commit_verify
from ..speculative.proposal import DraftProposal
from .logprobs import TokenLogprob, select_rows, token_logprobs
from .graphs import PROPOSED, GraphKey, StepGraphs, TargetGraphs, batch_view, kv_slot_mapping
from .sampler import VerifyOutput, sample_next, sampling_tensors, verify_ragged
from .scheduler import DecodePlan, PrefillPlan, Req
from .side_stream import SideStream


class Proposer(Protocol):
    """What a verify step needs from a drafting method (DFlash 2 or MTP), batched over requests."""

    def observe(self, batch: ForwardBatch, out, num_committed: Tensor | None) -> None:
        """The target ran ``batch`` (``out``: its FastOutput); the first ``num_committed[b]`` rows of
        sequence b are committed (None: all of them, a prefill)."""

    reads_block_tables: bool  # whether propose reads block_tables (else it may be None, and a captured
    # step uploads the batch's other fields while the proposal runs: StepGraphs.split_after_propose)

    # ``observe`` when it reads the target's taps alone (not the logits, the hidden rows or num_committed):
    # ``observe_taps(batch, taps)``, else None. A captured verify step then runs it on a side stream
    # from the last tapped layer on, beside the rest of the step (fast/engine/side_stream.py).
    observe_taps: Callable[[ForwardBatch, Tensor], None] | None

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor | None,
                k: int, st: SamplingTensors) -> DraftProposal:
        """k drafts per request (``block_tables [B, P]`` covers positions up to s + k)."""


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    emitted: list[int]  # num_accepted + 1 tokens
    trace: StepRecord | None


class ModelRunner:
    """Runs the steps of a scheduler on a target (and a proposer), on one device."""

    def __init__(self, target, pools, proposer: Proposer | None, *, page_size: int, device: torch.device,
                 trace: bool = False, graphs: TargetGraphs | None = None):
        self.target, self.pools, self.proposer = target, pools, proposer
        self.page_size, self.device, self.trace = page_size, device, trace
        self.graphs = graphs  # CUDA graphs of the decode and verify forwards (None: every step eager)
        self.step_graphs = None  # whole speculative steps as CUDA graphs (when a proposer runs on CUDA)
        # a proposer that does not say reads its block tables (the safe side: no early launch)
        self.proposer_reads_tables = getattr(proposer, "reads_block_tables", True)
        self.observe_taps = getattr(proposer, "observe_taps", None)  # the safe side again: observe at the end
        self.side = SideStream(device)
        if graphs is not None and proposer is not None:
            self.step_graphs = StepGraphs(pools, self.verify_step_fn, max_seqs=graphs.max_seqs,
                                          max_pages=graphs.max_pages,
                                          split_after_propose=not self.proposer_reads_tables)
        # Benchmarks only (bench/): drafts kept per verify step, called once per step. Random weights
        # accept nothing, so ``ft bench`` fixes the acceptance to time a step at a published length.
        # No serving path sets it: EngineConfig, LLM and ft generate/serve have no flag for it.
        self.simulated_accept: Callable[[], int] | None = None
        self.logprobs: list[list[TokenLogprob] | None] | None = None  # the last step's, when asked for
        self.epoch = 0  # steps run so far (prefill, decode, verify): StepGraphs' proposal ahead checks it

    # ---- batch building -------------------------------------------------------------------------

    def _tensor(self, values, dtype=torch.long) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def build_batch(self, reqs: Sequence[Req], starts: Sequence[int], lengths: Sequence[int], token_ids: Tensor,
                    *, is_verify: bool, logits_rows: Sequence[int], block_tables: Tensor | None = None) -> ForwardBatch:
        """Sequence b runs ``lengths[b]`` rows at positions ``starts[b]..``; ``token_ids [N]`` on the device.

        Built on the host as whole tensors (no loop over rows), then copied to the device once.
        """
        host_tables = self._page_table(reqs)  # [B, P] int64 on the host
        starts_t, lengths_t = torch.tensor(starts), torch.tensor(lengths)
        cu = torch.zeros(len(reqs) + 1, dtype=torch.long)
        cu[1:] = lengths_t.cumsum(0)
        seq = torch.repeat_interleave(torch.arange(len(reqs)), lengths_t)  # [N] the sequence of each row
        positions = starts_t[seq] + torch.arange(int(cu[-1])) - cu[:-1][seq]  # [N]
        kv_slots = kv_slot_mapping(host_tables, seq, positions, self.page_size)
        to_device = {"device": self.device}
        return ForwardBatch(
            token_ids=token_ids, positions=positions.to(**to_device), cu_seqlens=cu.to(torch.int32).to(**to_device),
            state_slots=self._tensor([r.slot for r in reqs]), kv_slot_mapping=kv_slots.to(**to_device),
            block_tables=host_tables.to(torch.int32).to(**to_device) if block_tables is None else block_tables,
            context_lens=(starts_t + lengths_t).to(**to_device), is_verify=is_verify,
            logits_rows=self._tensor(list(logits_rows)), max_query_len=max(lengths))

    def forward_uniform(self, reqs: Sequence[Req], starts: Sequence[int], rows: int, token_ids: Tensor, *,
                        is_verify: bool, logits_rows: Sequence[int],
                        block_tables: Tensor | None = None) -> tuple[ForwardBatch, object]:
        """The target over ``rows`` rows per request at ``starts[b]..``: by CUDA-graph replay when the
        step fits a captured shape (``fast/engine/graphs.py``), else eagerly. Returns (batch, output)."""
        key = self._graph_key(reqs, rows, is_verify)
        if key is not None:
            return self.graphs.run(key, token_ids, starts=starts, slots=[r.slot for r in reqs],
                                   tables=[r.pages for r in reqs], logits_rows=logits_rows)
        batch = self.build_batch(reqs, starts, [rows] * len(reqs), token_ids, is_verify=is_verify,
                                 logits_rows=logits_rows, block_tables=block_tables)
        return batch, self.target.forward(batch, self.pools)

    def _graph_key(self, reqs: Sequence[Req], rows: int, is_verify: bool) -> GraphKey | None:
        """The captured target forward a uniform step of ``rows`` rows per request replays, or None."""
        if self.graphs is None:
            return None
        return self.graphs.key_for(len(reqs), rows, max(len(r.pages) for r in reqs), is_verify)

    @staticmethod
    def _page_table(reqs: Sequence[Req], min_pages: int = 0) -> Tensor:
        """Each request's pages in order, -1 past its end  # [B, max_pages] int64 on the host."""
        max_pages = max(min_pages, *(len(r.pages) for r in reqs))
        return torch.tensor([r.pages + [-1] * (max_pages - len(r.pages)) for r in reqs], dtype=torch.long)

    def block_tables(self, reqs: Sequence[Req], min_pages: int = 0) -> Tensor:
        """Each request's pages in order, -1 past its end  # [B, max_pages] int32 on the device.

        ``min_pages`` widens the table: a proposer may address positions a request with fewer drafts
        than the batch never reaches (an MTP chain runs the batch's k); -1 there writes nothing.
        """
        return self._page_table(reqs, min_pages).to(dtype=torch.int32, device=self.device)

    def _no_drafts(self, batch: int) -> DraftProposal:
        """A proposal of k = 0 drafts (every request of the step has one token left)."""
        return DraftProposal.deterministic(torch.zeros(batch, 0, dtype=torch.long, device=self.device))

    def sampling(self, params: Sequence[SamplingParams]) -> SamplingTensors:
        return sampling_tensors(params, self.device)

    def _committed_logprobs(self, logits: Tensor, st: SamplingTensors, tokens: Tensor, owners: Sequence[int],
                            top_logprobs: Sequence[int | None]) -> list[list[TokenLogprob] | None]:
        """``logits [M, V]``, ``st`` and ``tokens [M]``: the committed tokens' rows; ``owners[m]``: the plan
        request row m belongs to (rows of one request in order). Per plan request, its TokenLogprobs."""
        result = [None if n is None else [] for n in top_logprobs]
        rows = [m for m, b in enumerate(owners) if top_logprobs[b] is not None]
        if rows:
            index = self._tensor(rows)
            for m, lp in zip(rows, token_logprobs(logits[index], select_rows(st, index), tokens[index],
                                                  [top_logprobs[owners[m]] for m in rows])):
                result[owners[m]].append(lp)
        return result

    # ---- steps ----------------------------------------------------------------------------------

    def prefill(self, plan: PrefillPlan, top_logprobs: Sequence[int | None] | None = None) -> list[int | None]:
        """Run the chunks; the first output token of each chunk that completes its prompt, else None."""
        self.epoch += 1
        self.logprobs = None
        chunks = plan.chunks
        reqs = [c.req for c in chunks]
        tokens = [t for c in chunks for t in c.req.prompt_ids[c.start:c.start + c.length]]
        ends = torch.tensor([c.length for c in chunks]).cumsum(0).tolist()
        done = [i for i, c in enumerate(chunks) if c.completes_prompt]
        batch = self.build_batch(reqs, [c.start for c in chunks], [c.length for c in chunks], self._tensor(tokens),
                                 is_verify=False, logits_rows=[ends[i] - 1 for i in done])
        out = self.target.forward(batch, self.pools)
        if self.proposer is not None:
            self.proposer.observe(batch, out, None)
        first: list[int | None] = [None] * len(chunks)
        if done:
            st = self.sampling([chunks[i].req.params for i in done])
            positions = self._tensor([chunks[i].req.prompt_len for i in done])
            sampled = sample_next(out.logits, st, positions)
            for i, token in zip(done, sampled.tolist()):
                first[i] = token
            if top_logprobs is not None:
                self.logprobs = self._committed_logprobs(out.logits, st, sampled, done, top_logprobs)
        return first

    def decode(self, plan: DecodePlan, top_logprobs: Sequence[int | None] | None = None) -> list[int]:
        """Plain decoding: one token per request."""
        self.epoch += 1
        self.logprobs = None
        reqs = plan.reqs
        anchors = [r.anchor_position for r in reqs]
        tokens = [r.output_ids[-1] for r in reqs]
        params = [r.params for r in reqs]
        positions = [a + 1 for a in anchors]
        key = self._graph_key(reqs, 1, False)
        if key is not None:  # one upload carries the batch, the tokens and the sampling parameters
            _, out = self.graphs.run(key, tokens, starts=anchors, slots=[r.slot for r in reqs],
                                     tables=[r.pages for r in reqs], logits_rows=range(len(reqs)),
                                     sampling=(params, positions))
            st, positions_t = self.graphs.sampling_views(key, len(reqs), HostSummary.of(params))
        else:
            st, positions_t = self.sampling(params), self._tensor(positions)
            batch = self.build_batch(reqs, anchors, [1] * len(reqs), self._tensor(tokens), is_verify=False,
                                     logits_rows=range(len(reqs)))
            out = self.target.forward(batch, self.pools)
        sampled = sample_next(out.logits, st, positions_t)
        if top_logprobs is not None:
            self.logprobs = self._committed_logprobs(out.logits, st, sampled, range(len(reqs)), top_logprobs)
        return sampled.tolist()

    def verify(self, plan: DecodePlan, top_logprobs: Sequence[int | None] | None = None) -> list[VerifyResult]:
        """One speculative step for every request of the plan (per-request k_b = ``plan.num_drafts``)."""
        self.epoch += 1
        self.logprobs = None
        reqs, num_drafts = plan.reqs, plan.num_drafts
        k = max(num_drafts)
        rows = k + 1
        if (self.step_graphs is not None and top_logprobs is None and not self.trace and k
                and min(num_drafts) == k):
            graphed = self._verify_graphed(reqs, k)
            if graphed is not None:
                return graphed
        st = self.sampling([r.params for r in reqs])
        anchor_list = [r.anchor_position for r in reqs]
        anchors = self._tensor(anchor_list)
        anchor_tokens = self._tensor([r.output_ids[-1] for r in reqs])
        slots = self._tensor([r.slot for r in reqs])
        tables = self.block_tables(reqs, -(-(max(anchor_list) + rows) // self.page_size))
        if k:
            proposal = self.proposer.propose(anchor_tokens, anchors, slots, tables, k, st)
        else:
            proposal = self._no_drafts(len(reqs))
        draft_tokens = proposal.tokens  # [B, k]
        # rows of request b: b * (k+1) + 0..k_b of [anchor, y_1..y_k]; padded back the same way
        flat_rows = [b * rows + i for b, kb in enumerate(num_drafts) for i in range(kb + 1)]
        token_ids = torch.cat([anchor_tokens[:, None], draft_tokens], dim=1).reshape(-1)[self._tensor(flat_rows)]
        lengths = [kb + 1 for kb in num_drafts]
        if len(set(lengths)) == 1:
            batch, out = self.forward_uniform(reqs, anchor_list, lengths[0], token_ids, is_verify=True,
                                              logits_rows=range(len(flat_rows)), block_tables=tables)
        else:  # requests near their end verify fewer drafts: a ragged step, run eagerly
            batch = self.build_batch(reqs, anchor_list, lengths, token_ids, is_verify=True,
                                     logits_rows=range(len(flat_rows)), block_tables=tables)
            out = self.target.forward(batch, self.pools)
        starts = torch.tensor([0] + lengths).cumsum(0).tolist()
        padded = [starts[b] + min(i, kb) for b, kb in enumerate(num_drafts) for i in range(rows)]
        logits = out.logits[self._tensor(padded)].reshape(len(reqs), rows, -1)  # [B, k+1, V]
        result = verify_ragged(logits, draft_tokens, proposal.cand_ids, proposal.draft_probs, num_drafts, st, anchors)
        if self.simulated_accept is not None and k:
            result = self._simulated(draft_tokens, num_drafts)
        num_committed = result.num_accepted + 1
        commit_verify(self.pools, batch, num_committed, out.meta)
        self.proposer.observe(batch, out, num_committed)
        accepted, emitted = result.num_accepted.tolist(), result.emitted.tolist()
        if top_logprobs is not None:  # the committed tokens sit at rows 0..num_accepted of each request
            owners = [b for b, a in enumerate(accepted) for _ in range(a + 1)]
            flat = self._tensor([b * rows + i for b, a in enumerate(accepted) for i in range(a + 1)])
            self.logprobs = self._committed_logprobs(
                logits.reshape(len(reqs) * rows, -1)[flat], select_rows(st, self._tensor(owners)),
                result.emitted.reshape(-1)[flat], owners, top_logprobs)
        traces = [None] * len(reqs)
        if self.trace:
            argmax, cands, probs = (logits.argmax(dim=2).tolist(), proposal.cand_ids.tolist(),
                                    proposal.draft_probs.tolist())
            traces = [StepRecord(anchor_list[b], draft_tokens[b, :kb].tolist(), cands[b][:kb], probs[b][:kb],
                                argmax[b][:kb + 1], accepted[b], emitted[b][:accepted[b] + 1])
                      for b, kb in enumerate(num_drafts)]
        return [VerifyResult(a, e[:a + 1], t) for a, e, t in zip(accepted, emitted, traces)]


    # ---- the whole speculative step as one CUDA-graph capture ------------------------------------

    def _verify_graphed(self, reqs: Sequence[Req], k: int) -> list[VerifyResult] | None:
        """``verify`` for requests that all draft k, by replaying the captured step; None if no graph fits.

        The step may launch the next one's proposal (``StepGraphs``, "Proposal ahead") when every request
        will draft k again, whatever it accepts now, on the same graph."""
        rows = k + 1
        anchors = [r.anchor_position for r in reqs]
        held = max(len(r.pages) for r in reqs)

        def key_through(positions: int) -> GraphKey | None:  # the bucket of pages covering max(anchors) + positions
            return self.step_graphs.key_for(len(reqs), rows, max(held, -(-(max(anchors) + positions)
                                                                         // self.page_size)), True)
        key = key_through(rows)
        if key is None:
            return None
        # after this step (at most k + 1 tokens) each request still has k + 1 to go, and the pages the next
        # one can need (anchor + 2 (k + 1) positions) fit the same page bucket
        ahead = all(r.max_new_tokens - len(r.output_ids) - rows > k for r in reqs) and key_through(2 * rows) == key
        params = [r.params for r in reqs]
        simulated = self.simulated_accept is not None  # a serving step's graph has no keep merge (GraphKey)
        key = replace(key, sampling=graph_summary(params), simulated=simulated)
        keep = self.simulated_accept() if simulated else -1
        results = self.step_graphs.run(key, anchors=anchors, slots=[r.slot for r in reqs],
                                       tables=[r.pages for r in reqs], anchor_tokens=[r.output_ids[-1] for r in reqs],
                                       params=params, keep=keep, epoch=self.epoch,
                                       ahead=ahead)  # per request [num_accepted, *emitted]
        return [VerifyResult(row[0], row[1:row[0] + 2], None) for row in results]

    def verify_step_fn(self, views: dict[str, Tensor], key: GraphKey) -> tuple[Tensor, Tensor]:
        """One speculative step over the static fields of ``key`` (captured by ``StepGraphs``):
        propose k drafts, run the target over [anchor, drafts], verify, commit the GDN state, observe.
        With ``key.simulated`` (benchmarks only), ``views["keep"] >= 0`` replaces the verify's acceptance by that
        many drafts; a serving step's graph has no such merge.

        A proposer with ``observe_taps`` observes on the side stream from the target's last tapped layer
        on (fast/engine/side_stream.py), joined at the end: the same values as observing after the commit
        (its inputs are the taps and the batch, its outputs the proposer's own state, read next step)."""
        b, rows = key.num_seqs, key.rows_per_seq
        k = rows - 1
        st = SamplingTensors(views["temperature"], views["top_k"], views["top_p"], views["seeds"], key.sampling)
        anchors, anchor_tokens = views["anchors"], views["anchor_tokens"]
        # a proposer that does not read the block tables runs before they are uploaded (StepGraphs)
        tables = views["block_tables"].view(b, key.pages).to(torch.int32) if self.proposer_reads_tables else None
        proposal = self.proposer.propose(anchor_tokens, anchors, views["state_slots"], tables, k, st)
        graph_cut(PROPOSED)  # the capture goes on in a new graph at each stage (fast/model/capture.py)
        token_ids = torch.cat([anchor_tokens[:, None], proposal.tokens], dim=1).reshape(-1)
        batch = batch_view(views, key, token_ids)
        early = self.observe_taps
        on_taps = None if early is None else (lambda taps: self.side.fork(lambda: early(batch, taps)))
        try:
            out = self.target.forward(batch, self.pools, on_taps=on_taps)
            num_accepted, emitted = self._verify_and_commit(out, batch, proposal, views, st, anchors, key)
            if early is None:
                self.proposer.observe(batch, out, num_accepted + 1)
        finally:
            self.side.join()  # before out (the taps) can be freed; also on an error, so no fork stays open
        return num_accepted, emitted

    def _verify_and_commit(self, out, batch: ForwardBatch, proposal: DraftProposal, views: dict[str, Tensor],
                           st: SamplingTensors, anchors: Tensor, key: GraphKey) -> tuple[Tensor, Tensor]:
        """The verify of a captured step's target output, and the GDN commit: ``(num_accepted, emitted)``."""
        b, rows = key.num_seqs, key.rows_per_seq
        k = rows - 1
        logits = out.logits.view(b, rows, -1)
        result = verify_ragged(logits, proposal.tokens, proposal.cand_ids, proposal.draft_probs, [k] * b, st, anchors)
        num_accepted, emitted = result.num_accepted, result.emitted
        if key.simulated:  # benchmarks only (GraphKey.simulated): keep[b] >= 0 drafts replace the verify's
            keep = views["keep"]
            num_accepted = torch.where(keep >= 0, keep.clamp(max=k), num_accepted)
            emitted = torch.where((keep >= 0)[:, None], torch.cat([proposal.tokens, proposal.tokens[:, :1]], dim=1),
                                  emitted)
        commit_verify(self.pools, batch, num_accepted + 1, out.meta)
        return num_accepted, emitted

    def _simulated(self, draft_tokens: Tensor, num_drafts: Sequence[int]) -> VerifyOutput:
        """Timing only: every request keeps ``simulated_accept()`` drafts (at most its k_b) and emits a
        draft token as its correction, so the step does what a real one with that acceptance does."""
        keep = self.simulated_accept()
        accepted = torch.tensor([min(keep, kb) for kb in num_drafts], dtype=torch.long, device=self.device)
        return VerifyOutput(accepted, torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1))


def graph_summary(params: Sequence[SamplingParams]) -> HostSummary:
    """The batch's HostSummary with max_top_k rounded up to a power of two (at least 16): a summary may
    only err towards more work, and the rounding keeps the number of captured step graphs small."""
    summary = HostSummary.of(params)
    if summary.max_top_k <= 0:
        return summary
    return replace(summary, max_top_k=max(16, 1 << (summary.max_top_k - 1).bit_length()))


class DFlashDrafter:
    """``FastDFlashProposer`` under the runner's :class:`Proposer` interface."""

    reads_block_tables = False  # the draft attends over its own ring, not the target's pages

    def __init__(self, proposer):
        self.proposer = proposer

    def observe(self, batch: ForwardBatch, out, num_committed: Tensor | None) -> None:
        self.observe_taps(batch, out.taps)

    def observe_taps(self, batch: ForwardBatch, taps: Tensor) -> None:
        self.proposer.observe_batch(batch, taps)  # every row, acceptance unknown; rejected ones are never read

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor, k: int,
                st: SamplingTensors):
        return self.proposer.propose(anchor_tokens, anchor_positions, slots, k, st.greedy, st.temperature, st.seeds,
                                     all_greedy=st.all_greedy)


class MTPDrafter:
    """``FastMTPProposer`` under the runner's :class:`Proposer` interface (argmax drafts: q one-hot)."""

    reads_block_tables = True  # the MTP layer attends over paged K/V
    observe_taps = None  # its observe reads the hidden rows and num_committed

    def __init__(self, proposer):
        self.proposer = proposer

    def observe(self, batch: ForwardBatch, out, num_committed: Tensor | None) -> None:
        self.proposer.observe(batch, out.hidden, num_committed)

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor, k: int,
                st: SamplingTensors):
        return self.proposer.propose(anchor_tokens, anchor_positions, slots, k, block_tables)
