"""Per-request sampling and verification for the engine's steps, on the kernels of ``fast/kernels``.

A batch mixes greedy and sampled requests, each with its own temperature, top-k, top-p and seed
(``SamplingTensors``, one row per request); randomness is the reference's keyed Philox:

- ``sample_next``: the token at position p is argmax (greedy) or the inverse-CDF draw of the
  filtered target distribution with u = uniform(seed, p, SAMPLE, 0) (``reference/generate.py``):
  the first token after a prefill and every token of plain decoding;
- ``verify_ragged``: ``reference/speculative/verify.py`` (greedy prefix match, sparse-q rejection with
  uniforms keyed (seed, s, ACCEPT, i), (seed, s, RESIDUAL, 0), (seed, s, BONUS, 0) at the anchor
  s) for requests with different k: a request near its max_tokens verifies fewer drafts, exactly
  as it would alone. The kernel verifies one k per call, so requests are grouped by k (one group
  in steady state). A request with k = 0 (one token left) emits its bonus token: the draw from p
  with (seed, s, BONUS, 0), argmax when greedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose
from dflash2.reference.request.sampling_params import SamplingParams

from ..kernels.sampling.rejection import verify
from ..kernels.sampling.sampler import SamplingTensors, sample


def sampling_tensors(params: Sequence[SamplingParams], device: torch.device) -> SamplingTensors:
    return SamplingTensors.from_params(params, device=device)


def sample_next(logits: Tensor, st: SamplingTensors, positions: Tensor) -> Tensor:
    """The token placed at ``positions [M]`` from the logits row before it  # [M, V] -> [M] long."""
    return sample(logits, st, positions, Purpose.SAMPLE, 0)


@dataclass(frozen=True)
class VerifyOutput:
    num_accepted: Tensor  # [B] long, 0..k_b
    emitted: Tensor  # [B, R] long: request b's first num_accepted + 1 entries are its committed tokens


def verify_ragged(logits: Tensor, draft_tokens: Tensor, cand_ids: Tensor, draft_probs: Tensor,
                  num_drafts: Sequence[int], st: SamplingTensors, anchor_positions: Tensor) -> VerifyOutput:
    """logits [B, R, V] (request b's row i predicts its slot i+1; rows past k_b unused), draft_tokens
    [B, R-1], cand_ids / draft_probs [B, R-1, K], num_drafts: k_b <= R-1 per request (host ints)."""
    batch, rows = logits.shape[:2]
    device = logits.device
    if num_drafts and set(num_drafts) == {rows - 1} and rows > 1:  # every request verifies all its rows: one
        # call, its outputs as they are (a captured step's usual case: no fills or copies around it)
        return VerifyOutput(*verify(logits, st, draft_tokens, cand_ids, draft_probs, anchor_positions))
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    emitted = torch.full((batch, rows), -1, dtype=torch.long, device=device)
    for k in sorted(set(num_drafts)):
        members = [b for b, kb in enumerate(num_drafts) if kb == k]
        if len(members) == batch:
            index = slice(None)
        else:
            index = torch.tensor(members, dtype=torch.long, device=device)
        group_st = st if len(members) == batch else st.select(index)
        if k == 0:
            emitted[index, 0] = sample(logits[index, 0], group_st, anchor_positions[index], Purpose.BONUS, 0)
            continue
        accepted, tokens = verify(logits[index, :k + 1], group_st, draft_tokens[index, :k],
                                  cand_ids[index, :k], draft_probs[index, :k], anchor_positions[index])
        num_accepted[index] = accepted
        emitted[index, :k + 1] = tokens
    return VerifyOutput(num_accepted, emitted)
