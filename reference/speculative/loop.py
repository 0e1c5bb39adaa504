"""The speculative loop for one request: propose k tokens, verify them with the target, commit.

State between steps: the committed tokens, the target cache holding every committed token but
the last (the anchor t0 at position s, not yet run through the target), and the proposer.

One step, anchor t0 at position s:

1. ``proposal = proposer.propose(t0, s, k)``: y_1..y_k for positions s+1..s+k with q_1..q_k;
2. the target runs over ``[t0, y_1..y_k]`` (positions s..s+k); row i gives p_{i+1};
3. verify: greedy prefix match, or sparse-q rejection with uniforms keyed by (seed, s, purpose,
   slot) (``reference/speculative/verify.py``): ``num_accepted`` a drafts kept, ``num_emitted = a + 1``
   tokens committed (y_1..y_a and the correction or bonus token);
4. GDN rollback by replay: the target's recurrent state cannot drop rows, so when a < k the
   cache is restored from the snapshot taken before step 2 and the target re-runs over
   ``[t0, y_1..y_a]``; full-attention K/V rows past the frontier go with the snapshot;
5. ``proposer.observe`` sees all k+1 rows with ``num_committed = a + 1``; the last emitted
   token becomes the next anchor at s + a + 1.

Prefix cache (``reference/speculative/prefix.py``): with a store, the request starts from the
longest snapshot that begins its prompt, prefills the rest in chunks ending at multiples of
``snapshot_interval`` (a snapshot at each), and leaves a snapshot of its committed state (the
tokens before the last anchor) when it finishes.

Plain decoding (``algorithm = "none"``) is ``reference/generate.py``. A step with no drafts emits
one token with the same law as plain decoding, and the same token when greedy; a sampled one is
drawn with the key (seed, s, BONUS, 0) instead of plain decoding's (seed, s+1, SAMPLE, 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..generate import GenerationResult, check_prompt, next_token
from .prefix import PrefixStore, prefill, restore_longest, take_snapshot
from .proposer import Proposal, Proposer
from .sampling import greedy_token, target_probs
from ..request.sampling_params import SamplingParams
from ..request.stopping import Stopper, timing
from ..model.target import ReferenceTarget
from ..request.trace import StepRecord
from .verify import verify_greedy, verify_sampled_keyed


@dataclass
class SpeculativeResult(GenerationResult):
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return sum(len(s.emitted) for s in self.steps) / max(len(self.steps), 1)


def verify_step(target: ReferenceTarget, cache, anchor_token: int, anchor_position: int, proposal: Proposal,
                params: SamplingParams):
    """Steps 2-4 above: returns (the verify forward's output, num_accepted, emitted, the cache after commit)."""
    drafts = proposal.tokens.tolist()
    snapshot = cache.clone()
    out = target.forward(torch.tensor([anchor_token] + drafts), cache)  # rows s..s+k
    if params.greedy:
        result = verify_greedy(proposal.tokens, out.logits)
    else:
        probs = torch.stack([target_probs(row, params) for row in out.logits])
        result = verify_sampled_keyed(proposal.tokens, proposal.cand_ids, proposal.draft_probs, probs,
                                      params.seed, anchor_position)
    if result.num_accepted < len(drafts):
        cache = snapshot
        target.forward(torch.tensor([anchor_token] + drafts[:result.num_accepted]), cache)
    return out, result.num_accepted, list(result.emitted), cache


def speculative_generate(
    target: ReferenceTarget,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    k: int,
    stop_token_ids: Sequence[int] = (),
    decode: Callable[[list[int]], str] | None = None,
    snapshot_interval: int | None = None,
    store: PrefixStore | None = None,
) -> SpeculativeResult:
    """Decode one request speculatively with k drafts per verify (fewer near the request's end: k_step).

    ``snapshot_interval``: prefill in chunks ending at its multiples; ``store``: the prefix cache to
    start from and to leave snapshots in (the module docstring). Neither: one prefill forward.
    """
    cfg = target.cfg
    check_prompt(prompt_ids, params, cfg.vocab_size, cfg.max_position_embeddings)
    stopper = Stopper(params, stop_token_ids, decode)
    start = time.perf_counter()
    prompt = list(prompt_ids)
    cache = restore_longest(target, proposer, prompt, store)
    out = prefill(target, proposer, prompt, cache, snapshot_interval, store)
    anchor, position = next_token(out.logits[-1], params, len(prompt)), len(prompt)
    committed = list(prompt)  # the tokens at positions 0 .. position-1, all through the target
    prefill_end = time.perf_counter()
    output, finish = stopper.check([anchor])
    steps: list[StepRecord] = []
    while finish is None:
        # a step emits up to k + 1 tokens: draft no further than the request's end; with one
        # token left the step verifies no drafts and emits the target's own (bonus) token
        k_step = min(k, params.max_tokens - len(output) - 1)
        proposal = proposer.propose(anchor, position, k_step, params) if k_step > 0 else Proposal.deterministic([])
        rows, num_accepted, emitted, cache = verify_step(target, cache, anchor, position, proposal, params)
        proposer.observe([anchor] + proposal.tokens.tolist(), position, rows, num_accepted + 1)
        steps.append(StepRecord(position, proposal.tokens.tolist(), proposal.cand_ids.tolist(),
                                proposal.draft_probs.tolist(), [greedy_token(r) for r in rows.logits],
                                num_accepted, emitted))
        output, finish = stopper.check(output + emitted)
        # the cache holds t0 and the kept drafts (a stop id among them may have cut ``output`` short)
        committed += [anchor] + emitted[:-1]
        anchor, position = emitted[-1], position + num_accepted + 1
    if store is not None:
        store.put(take_snapshot(committed, cache, proposer))
    return SpeculativeResult(prompt, output, finish, stopper.final_text(output),
                             timing(start, prefill_end, time.perf_counter(), len(output)), steps)
