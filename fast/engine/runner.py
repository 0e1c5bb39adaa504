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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor

from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.request.trace import StepRecord

from ..kernels.sampler import SamplingTensors
from ..model.batch import ForwardBatch
from ..model.pools import commit_verify
from ..speculative.proposal import DraftProposal
from .sampler import sample_next, sampling_tensors, verify_ragged
from .scheduler import DecodePlan, PrefillPlan, Req


class Proposer(Protocol):
    """What a verify step needs from a drafting method (DFlash 2 or MTP), batched over requests."""

    def observe(self, batch: ForwardBatch, out, num_committed: Tensor | None) -> None:
        """The target ran ``batch`` (``out``: its FastOutput); the first ``num_committed[b]`` rows of
        sequence b are committed (None: all of them, a prefill)."""

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor, k: int,
                st: SamplingTensors) -> DraftProposal:
        """k drafts per request (``block_tables [B, P]`` covers positions up to s + k)."""


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    emitted: list[int]  # num_accepted + 1 tokens
    trace: StepRecord | None


class ModelRunner:
    """Runs the steps of a scheduler on a target (and a proposer), on one device."""

    def __init__(self, target, pools, proposer: Proposer | None, *, page_size: int, device: torch.device,
                 trace: bool = False):
        self.target, self.pools, self.proposer = target, pools, proposer
        self.page_size, self.device, self.trace = page_size, device, trace

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
        kv_slots = host_tables[seq, positions // self.page_size] * self.page_size + positions % self.page_size
        to_device = {"device": self.device}
        return ForwardBatch(
            token_ids=token_ids, positions=positions.to(**to_device), cu_seqlens=cu.to(torch.int32).to(**to_device),
            state_slots=self._tensor([r.slot for r in reqs]), kv_slot_mapping=kv_slots.to(**to_device),
            block_tables=host_tables.to(torch.int32).to(**to_device) if block_tables is None else block_tables,
            context_lens=(starts_t + lengths_t).to(**to_device), is_verify=is_verify,
            logits_rows=self._tensor(list(logits_rows)), max_query_len=max(lengths))

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

    # ---- steps ----------------------------------------------------------------------------------

    def prefill(self, plan: PrefillPlan) -> list[int | None]:
        """Run the chunks; the first output token of each chunk that completes its prompt, else None."""
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
            for i, token in zip(done, sample_next(out.logits, st, positions).tolist()):
                first[i] = token
        return first

    def decode(self, plan: DecodePlan) -> list[int]:
        """Plain decoding: one token per request."""
        reqs = plan.reqs
        anchors = [r.anchor_position for r in reqs]
        batch = self.build_batch(reqs, anchors, [1] * len(reqs), self._tensor([r.output_ids[-1] for r in reqs]),
                                 is_verify=False, logits_rows=range(len(reqs)))
        out = self.target.forward(batch, self.pools)
        st = self.sampling([r.params for r in reqs])
        return sample_next(out.logits, st, self._tensor(anchors) + 1).tolist()

    def verify(self, plan: DecodePlan) -> list[VerifyResult]:
        """One speculative step for every request of the plan (per-request k_b = ``plan.num_drafts``)."""
        reqs, num_drafts = plan.reqs, plan.num_drafts
        k = max(num_drafts)
        rows = k + 1
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
        batch = self.build_batch(reqs, anchor_list, lengths, token_ids, is_verify=True,
                                 logits_rows=range(len(flat_rows)), block_tables=tables)
        out = self.target.forward(batch, self.pools)
        starts = torch.tensor([0] + lengths).cumsum(0).tolist()
        padded = [starts[b] + min(i, kb) for b, kb in enumerate(num_drafts) for i in range(rows)]
        logits = out.logits[self._tensor(padded)].reshape(len(reqs), rows, -1)  # [B, k+1, V]
        result = verify_ragged(logits, draft_tokens, proposal.cand_ids, proposal.draft_probs, num_drafts, st, anchors)
        num_committed = result.num_accepted + 1
        commit_verify(self.pools, batch, num_committed)
        self.proposer.observe(batch, out, num_committed)
        accepted, emitted = result.num_accepted.tolist(), result.emitted.tolist()
        traces = [None] * len(reqs)
        if self.trace:
            argmax, cands, probs = (logits.argmax(dim=2).tolist(), proposal.cand_ids.tolist(),
                                    proposal.draft_probs.tolist())
            traces = [StepRecord(anchor_list[b], draft_tokens[b, :kb].tolist(), cands[b][:kb], probs[b][:kb],
                                argmax[b][:kb + 1], accepted[b], emitted[b][:accepted[b] + 1])
                      for b, kb in enumerate(num_drafts)]
        return [VerifyResult(a, e[:a + 1], t) for a, e, t in zip(accepted, emitted, traces)]


class DFlashDrafter:
    """``FastDFlashProposer`` under the runner's :class:`Proposer` interface."""

    def __init__(self, proposer):
        self.proposer = proposer

    def observe(self, batch: ForwardBatch, out, num_committed: Tensor | None) -> None:
        self.proposer.observe_batch(batch, out.taps)  # every row; rejected ones are never read

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor, k: int,
                st: SamplingTensors):
        return self.proposer.propose(anchor_tokens, anchor_positions, slots, k, st.greedy, st.temperature, st.seeds)


class MTPDrafter:
    """``FastMTPProposer`` under the runner's :class:`Proposer` interface (argmax drafts: q one-hot)."""

    def __init__(self, proposer):
        self.proposer = proposer

    def observe(self, batch: ForwardBatch, out, num_committed: Tensor | None) -> None:
        self.proposer.observe(batch, out.hidden, num_committed)

    def propose(self, anchor_tokens: Tensor, anchor_positions: Tensor, slots: Tensor, block_tables: Tensor, k: int,
                st: SamplingTensors):
        return self.proposer.propose(anchor_tokens, anchor_positions, slots, k, block_tables)
