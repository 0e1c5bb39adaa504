"""The model runner: a scheduler plan in, committed tokens out; each step by graph replay where one fits, else
eagerly.

Three kinds of step (``Scheduler.schedule``):

- prefill: chunks of prompts, one row per prompt token (a captured forward where the chunks are short,
  ``prefill_graphs.PrefillGraphs``, else eagerly, ``eager_step.py``); the proposer sees
  every row (DFlash writes its ring, MTP its pairs); a chunk that completes its prompt samples the first output
  token at position n = len(prompt) with the key (seed, n, SAMPLE, 0);
- plain decode: one row per request, the anchor at s; the next token is sampled at s + 1 with
  (seed, s + 1, SAMPLE, 0). A captured target forward (``graph_step.TargetGraphs``) where the batch fits one;
- verify: a speculative step (``fast/speculative/step.py``) for every request, k_b = ``plan.ks[b]``
  drafts each (a request near its end drafts fewer, which is what it would draft alone: every slot's draw is
  keyed by its own slot). The batch's largest k is proposed and each request verifies its own k_b
  (``verify_ragged``): a captured whole step (``graph_step.StepGraphs``, every request running k + 1 rows)
  unless a trace or logprobs are asked for; otherwise eagerly, each request running its own k_b + 1 rows.

The one device-to-host read per step is the committed tokens.

Overlap scheduling (``EngineConfig.overlap_schedule``): a captured speculative step whose requests all draft k
and will all draft k again may launch the whole next step before its own result is read, when the engine's
``launch_next`` says the next step is that one (no request waiting, the depth k again; it allocates the pages the
next step can reach). The step's rows come back as usual, the next one is left in flight (``in_flight``) and the
engine's next call is :meth:`ModelRunner.collect`, which may launch the one after it in turn. So the host commits
step n, checks stops and fills step n + 1's tables while the GPU runs step n + 1 (SGLang's overlap scheduler,
vLLM's async scheduling). A request that ended meanwhile is in the step in flight: its rows are computed (on its
freed slot and pages, before any later step can reuse them: one stream) and dropped by the engine.

Logprobs (optional, off by default): a step given ``top_logprobs`` (one entry per plan request: None for a
request that wants none, else how many alternatives) also leaves in ``self.logprobs``, per plan request, a
:class:`TokenLogprob` for each token it committed (before any stop cut), read from the target's filtered
distribution at that token's row (``logprobs.py``): the prefill row that completes a prompt, the decode row, or
verify rows 0..num_accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torch import Tensor

from dflash2.reference.request.trace import StepRecord

from ..kernels.sampling.sampler import HostSummary, SamplingTensors
from ..model.pools import CachePools
from ..model.target import FastTarget
from ..speculative.step import SpeculativeStep
from .eager_step import EagerStep
from .graphs.graph_step import StepGraphs, TargetGraphs, graph_summary
from .logprobs import TokenLogprob, select_rows, token_logprobs
from .graphs.prefill_graphs import PrefillGraphs
from .sampling import sample_next, sampling_tensors
from .scheduler import DecodePlan, PrefillPlan, Req


@dataclass(frozen=True)
class InFlight:
    """A speculative step launched before the one before it was read: its requests (plan order) and depth."""

    reqs: list[Req]
    k: int


# the engine's consent to launching the next step of ``reqs`` at depth k before this one is read (it allocates
# the pages that step can reach when it consents)
LaunchNext = Callable[[Sequence[Req], int], bool]


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    emitted: list[int]  # num_accepted + 1 tokens
    trace: StepRecord | None


class ModelRunner:
    """Runs the steps of a scheduler on a target (and a speculative step), on one device.

    ``graphs`` (CUDA) captures decode forwards; with a speculative step, whole speculative steps are captured
    too (``propose_ahead``: ``EngineConfig.propose_ahead``).
    """

    def __init__(self, target: FastTarget, pools: CachePools, spec: SpeculativeStep | None, *, page_size: int,
                 device: torch.device, trace: bool = False, graphs: TargetGraphs | None = None,
                 propose_ahead: bool = True, overlap: bool = True, whole_step_graphs: bool = True):
        self.target, self.pools, self.spec = target, pools, spec
        self.page_size, self.device, self.trace = page_size, device, trace
        self.eager = EagerStep(target, pools, page_size=page_size, device=device)
        self.graphs = graphs  # CUDA graphs of the decode and verify forwards (None: every step eager)
        # CUDA graphs of short prefill chunks (prefill_graphs.py; None: every prefill chunk eager)
        self.prefill_graphs: PrefillGraphs | None = None
        # whole speculative steps as CUDA graphs (whole_step_graphs False, tensor parallelism: the proposer is rank
        # 0's alone, so a speculative step replays its target forward from ``graphs`` and runs the rest eagerly)
        self.step_graphs = None
        if graphs is not None and spec is not None and whole_step_graphs:
            self.step_graphs = StepGraphs(spec, max_seqs=graphs.max_seqs, max_pages=graphs.max_pages,
                                          propose_ahead=propose_ahead)
        self.logprobs: list[list[TokenLogprob] | None] | None = None  # the last step's, when asked for
        self.epoch = 0  # steps run so far (prefill, decode, verify): StepGraphs' proposal ahead checks it
        self.graph_plain_steps = False  # whether a verify step of no drafts at all replays a captured step too
        self.overlap = overlap  # whether a steady speculative step may launch the next one before it is read
        self.in_flight: InFlight | None = None  # the step so launched, until ``collect``

    def sampling(self, params) -> SamplingTensors:
        return sampling_tensors(params, self.device)

    def _graph_key(self, reqs: Sequence[Req], rows: int, is_verify: bool):
        """The captured target forward a uniform step of ``rows`` rows per request replays, or None."""
        if self.graphs is None:
            return None
        return self.graphs.key_for(len(reqs), rows, max(len(r.pages) for r in reqs), is_verify)

    def _committed_logprobs(self, logits: Tensor, st: SamplingTensors, tokens: Tensor, owners: Sequence[int],
                            top_logprobs: Sequence[int | None]) -> list[list[TokenLogprob] | None]:
        """``logits [M, V]``, ``st`` and ``tokens [M]``: the committed tokens' rows; ``owners[m]``: the plan
        request row m belongs to (rows of one request in order). Per plan request, its TokenLogprobs."""
        result = [None if n is None else [] for n in top_logprobs]
        rows = [m for m, b in enumerate(owners) if top_logprobs[b] is not None]
        if rows:
            index = self.eager.tensor(rows)
            for m, lp in zip(rows, token_logprobs(logits[index], select_rows(st, index), tokens[index],
                                                  [top_logprobs[owners[m]] for m in rows])):
                result[owners[m]].append(lp)
        return result

    # ---- steps ----------------------------------------------------------------------------------

    def prefill(self, plan: PrefillPlan, top_logprobs: Sequence[int | None] | None = None) -> list[int | None]:
        """Run the chunks; the first output token of each chunk that completes its prompt, else None."""
        assert self.in_flight is None, "collect the step in flight first"
        self.epoch += 1
        self.logprobs = None
        chunks = plan.chunks
        reqs = [c.req for c in chunks]
        tokens = [t for c in chunks for t in c.req.prompt_ids[c.start:c.start + c.length]]
        starts, lengths = [c.start for c in chunks], [c.length for c in chunks]
        ends = torch.tensor(lengths).cumsum(0).tolist()
        done = [i for i, c in enumerate(chunks) if c.completes_prompt]
        logits_rows = [ends[i] - 1 for i in done]
        key = None
        if self.prefill_graphs is not None and top_logprobs is None:
            key = self.prefill_graphs.key_for(lengths)
        if key is not None:  # a short chunk: one replay of the forward and the proposer's observe
            _, out = self.prefill_graphs.run(key, starts=starts, lengths=lengths, slots=[r.slot for r in reqs],
                                             tables=[r.pages for r in reqs], tokens=tokens, logits_rows=logits_rows)
        else:
            batch, out = self.eager.forward(reqs, starts, lengths, self.eager.tensor(tokens), is_verify=False,
                                            logits_rows=logits_rows)
            if self.spec is not None:
                self.spec.proposer.observe(batch, out, None)
        first: list[int | None] = [None] * len(chunks)
        if done:
            st = self.sampling([chunks[i].req.params for i in done])
            positions = self.eager.tensor([chunks[i].req.prompt_len for i in done])
            sampled = sample_next(out.logits, st, positions)
            for i, token in zip(done, sampled.tolist()):
                first[i] = token
            if top_logprobs is not None:
                self.logprobs = self._committed_logprobs(out.logits, st, sampled, done, top_logprobs)
        return first

    def decode(self, plan: DecodePlan, top_logprobs: Sequence[int | None] | None = None) -> list[int]:
        """Plain decoding: one token per request."""
        assert self.in_flight is None, "collect the step in flight first"
        self.epoch += 1
        self.logprobs = None
        reqs = plan.reqs
        anchors = [r.anchor_position for r in reqs]
        tokens = [r.output_ids[-1] for r in reqs]
        params = [r.params for r in reqs]
        positions = [a + 1 for a in anchors]
        key = self._graph_key(reqs, 1, False)
        if key is not None:  # one upload carries the batch, the tokens and the sampling parameters; one replay
            key = replace(key, sampling=graph_summary(params))  # draws the next tokens too
            _, out, sampled = self.graphs.run(key, tokens, starts=anchors, slots=[r.slot for r in reqs],
                                              tables=[r.pages for r in reqs], logits_rows=range(len(reqs)),
                                              sampling=(params, positions))
            if top_logprobs is not None:
                st, _ = self.graphs.sampling_views(key, len(reqs), HostSummary.of(params))
        else:
            st, positions_t = self.sampling(params), self.eager.tensor(positions)
            _, out = self.eager.forward(reqs, anchors, [1] * len(reqs), self.eager.tensor(tokens), is_verify=False,
                                        logits_rows=range(len(reqs)))
            sampled = sample_next(out.logits, st, positions_t)
        if top_logprobs is not None:
            self.logprobs = self._committed_logprobs(out.logits, st, sampled, range(len(reqs)), top_logprobs)
        return sampled.tolist()

    def verify(self, plan: DecodePlan, top_logprobs: Sequence[int | None] | None = None,
               launch_next: LaunchNext | None = None) -> list[VerifyResult]:
        """One speculative step for every request of the plan (per-request k_b = ``plan.ks``); with
        ``launch_next``, the step may leave the next one in flight (module docstring)."""
        assert self.in_flight is None, "collect the step in flight first"
        self.epoch += 1
        self.logprobs = None
        reqs, ks = plan.reqs, plan.ks
        k = max(ks)
        if self.step_graphs is not None and top_logprobs is None and not self.trace and (k or self.graph_plain_steps):
            graphed = self._verify_graphed(reqs, ks, launch_next)
            if graphed is not None:
                return graphed
        return self._verify_eager(reqs, ks, top_logprobs)

    def _verify_eager(self, reqs: Sequence[Req], ks: Sequence[int],
                      top_logprobs: Sequence[int | None] | None) -> list[VerifyResult]:
        spec, eager = self.spec, self.eager
        k = max(ks)
        rows = k + 1
        st = self.sampling([r.params for r in reqs])
        anchor_list = [r.anchor_position for r in reqs]
        anchors = eager.tensor(anchor_list)
        anchor_tokens = eager.tensor([r.output_ids[-1] for r in reqs])
        slots = eager.tensor([r.slot for r in reqs])
        tables = eager.block_tables(reqs, -(-(max(anchor_list) + rows) // self.page_size))
        proposal = spec.propose(anchor_tokens, anchors, slots, tables, k, st)
        draft_tokens = proposal.tokens  # [B, k]
        # rows of request b: b * (k+1) + 0..k_b of [anchor, y_1..y_k]; padded back the same way
        flat_rows = [b * rows + i for b, kb in enumerate(ks) for i in range(kb + 1)]
        token_ids = torch.cat([anchor_tokens[:, None], draft_tokens], dim=1).reshape(-1)[eager.tensor(flat_rows)]
        lengths = [kb + 1 for kb in ks]
        drafts = k > 0  # a step of no drafts at all runs as a decode (SpeculativeStep.verify_uniform)
        key = self._graph_key(reqs, lengths[0], drafts) if len(set(lengths)) == 1 else None
        sampling = None
        if key is not None and not drafts:  # the plain decode's capture (its draw unused): no capture of its own
            params = [r.params for r in reqs]
            key, sampling = replace(key, sampling=graph_summary(params)), (params, [a + 1 for a in anchor_list])
        if key is not None:  # a uniform step: the captured verify (or decode) forward
            batch, out, _ = self.graphs.run(key, token_ids, starts=anchor_list, slots=[r.slot for r in reqs],
                                            tables=[r.pages for r in reqs], logits_rows=range(len(flat_rows)),
                                            sampling=sampling)
        else:  # no graph, or requests near their end verify fewer drafts: a ragged step, run eagerly
            batch, out = eager.forward(reqs, anchor_list, lengths, token_ids, is_verify=drafts,
                                       logits_rows=range(len(flat_rows)), block_tables=tables)
        starts = torch.tensor([0] + lengths).cumsum(0).tolist()
        padded = [starts[b] + min(i, kb) for b, kb in enumerate(ks) for i in range(rows)]
        logits = out.logits[eager.tensor(padded)].reshape(len(reqs), rows, -1)  # [B, k+1, V]
        result = spec.verifier(logits, proposal, ks, st, anchors)
        spec.commit_and_observe(batch, out, result.num_accepted)
        accepted, emitted = result.num_accepted.tolist(), result.emitted.tolist()
        if top_logprobs is not None:  # the committed tokens sit at rows 0..num_accepted of each request
            owners = [b for b, a in enumerate(accepted) for _ in range(a + 1)]
            flat = eager.tensor([b * rows + i for b, a in enumerate(accepted) for i in range(a + 1)])
            self.logprobs = self._committed_logprobs(
                logits.reshape(len(reqs) * rows, -1)[flat], select_rows(st, eager.tensor(owners)),
                result.emitted.reshape(-1)[flat], owners, top_logprobs)
        traces = [None] * len(reqs)
        if self.trace:
            argmax, cands, probs = (logits.argmax(dim=2).tolist(), proposal.cand_ids.tolist(),
                                    proposal.draft_probs.tolist())
            traces = [StepRecord(anchor_list[b], draft_tokens[b, :kb].tolist(), cands[b][:kb], probs[b][:kb],
                                 argmax[b][:kb + 1], accepted[b], emitted[b][:accepted[b] + 1])
                      for b, kb in enumerate(ks)]
        return [VerifyResult(a, e[:a + 1], t) for a, e, t in zip(accepted, emitted, traces)]

    def collect(self, launch_next: LaunchNext | None = None) -> list[VerifyResult]:
        """The results of the step in flight, one per request it was launched with (finished ones included);
        with ``launch_next``, the step after it may be launched first, as in :meth:`verify`."""
        flight, self.in_flight = self.in_flight, None
        self.epoch += 1
        self.logprobs = None
        reqs, k = flight.reqs, flight.k
        key = self.step_graphs.in_flight[0]
        next_tables = self._next_tables(reqs, [k] * len(reqs), key, launch_next)
        rows = self.step_graphs.collect(next_tables)
        if next_tables is not None:
            self.in_flight = flight
        return [VerifyResult(row[0], row[1:row[0] + 2], None) for row in rows]

    def drop_in_flight(self) -> None:
        """Forget a step launched ahead without reading it (after a step raised: its requests are failed)."""
        self.in_flight = None
        if self.step_graphs is not None:
            self.step_graphs.in_flight = None

    def _next_tables(self, reqs: Sequence[Req], ks: Sequence[int], key, launch_next: LaunchNext | None
                     ) -> list[list[int]] | None:
        """The page tables of the next step of ``reqs`` when it may launch now (overlap scheduling), else None:
        every request drafting k now and, whatever this step accepts, next (k + 1 tokens to go after it), the next
        step's pages within this key's bucket, and the engine's consent."""
        k = key.rows_per_seq - 1
        if not (self.overlap and launch_next is not None and min(ks) == k and self._ahead(reqs, k, key)):
            return None
        if not launch_next(reqs, k):
            return None
        return [r.pages for r in reqs]

    def _ahead(self, reqs: Sequence[Req], k: int, key) -> bool:
        """Whether the next step of ``reqs`` (the host knowing their anchors for this one) drafts k for every
        request whatever this one accepts, on a key of the same page bucket: after this step (at most k + 1
        tokens) each still has k + 1 to go, and the positions the next one can write (below anchor + 2 (k + 1))
        fit the bucket."""
        rows = k + 1
        anchors = [r.anchor_position for r in reqs]
        if not all(r.max_new_tokens - len(r.output_ids) - rows > k for r in reqs):
            return False
        pages = max(max(len(r.pages) for r in reqs), -(-(max(anchors) + 2 * rows) // self.page_size))
        bucket = self.step_graphs.key_for(len(reqs), rows, pages, k > 0)
        return bucket is not None and bucket.pages == key.pages

    def _verify_graphed(self, reqs: Sequence[Req], ks: Sequence[int],
                        launch_next: LaunchNext | None = None) -> list[VerifyResult] | None:
        """``verify`` by replaying the captured step of k = max(ks) (request b verifying its first ks[b] drafts);
        None if no graph fits.

        The step may launch the next one's proposal (``propose_ahead.py``) when every request will draft k again,
        whatever it accepts now, on the same graph, or the whole next step (``launch_next``: overlap scheduling)."""
        k = max(ks)
        rows = k + 1
        anchors = [r.anchor_position for r in reqs]
        held = max(len(r.pages) for r in reqs)

        def key_through(end: int):  # the bucket of pages covering positions below ``end``
            return self.step_graphs.key_for(len(reqs), rows, max(held, -(-end // self.page_size)), k > 0)
        # the positions each request verifies (rows past its k_b write nothing where it holds no page)
        key = key_through(max(a + kb + 1 for a, kb in zip(anchors, ks)))
        if key is None:
            return None
        ahead = min(ks) == k and self._ahead(reqs, k, key)
        params = [r.params for r in reqs]
        key = replace(key, sampling=graph_summary(params))
        tables = [list(r.pages) for r in reqs]  # copied: launch_next extends them for the next step
        next_tables = self._next_tables(reqs, ks, key, launch_next) if ahead else None
        results = self.step_graphs.run(key, anchors=anchors, slots=[r.slot for r in reqs], tables=tables,
                                       anchor_tokens=[r.output_ids[-1] for r in reqs], params=params, ks=ks,
                                       epoch=self.epoch, ahead=ahead,
                                       next_tables=next_tables)  # [num_accepted, *emitted] per request
        if next_tables is not None:
            self.in_flight = InFlight(list(reqs), k)
        return [VerifyResult(row[0], row[1:row[0] + 2], None) for row in results]
