"""Simulated acceptance, for timing speculative steps on random weights (``ft bench --simulate-tokens-per-step``).

Random weights accept almost no drafts, so a verify step of a real-shape model would commit one token and never
exercise the work a real acceptance rate causes. :class:`SimulatedVerifier` wraps the engine's verifier: the
real verify still runs (its kernels are part of the step's cost), then each request's acceptance is replaced by
the schedule's count for this step (at most its k_b) and its emitted tokens by its own drafts, so the step
commits, rolls back and observes exactly what a real step with that acceptance does. It lives here, in
``bench/``: no serving path can install it, and every output of ``ft bench`` labels the runs that used it.

The count per step comes from :class:`SimulatedAcceptance`. The benchmark sets it before each step
(:meth:`SimulatedVerifier.next_step`) into a device scalar that captured steps read, so a replayed step keeps
what the schedule says without being captured again.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from dflash2.fast.kernels.sampling.sampler import SamplingTensors
from dflash2.fast.speculative.proposer import DraftProposal
from dflash2.fast.speculative.verify import Verifier, VerifyOutput


SEED = "seed"  # --simulate-tokens-per-step seed (bench/cli.py): each setting at the seed's own tokens per step
# The seed's measured tokens per verify step (its "All settings" table: one request, AIME25 problem 1, temperature 1,
# top-p 0.95, top-k 20, bf16; ../shared/seed), by target family: the dense 27B and the MoE 35B-A3B. Real shapes
# with dummy weights take their family's row, so MTP and DFlash compare as the seed's table does.
SEED_TOKENS_PER_STEP = {
    "dense": {"mtp3": 3.10, "mtp7": 4.51, "dflash3": 3.40, "dflash7": 5.47},
    "moe": {"mtp3": 3.25, "mtp7": 4.52, "dflash3": 3.52, "dflash7": 5.39},
}


def tokens_per_step(simulate: float | str | None, setting: str, is_moe: bool) -> float | None:
    """The simulated tokens per step of ``setting``: ``simulate`` itself, the seed's figure for the setting and the
    target's family (``SEED``), or None (real acceptance; also for plain decoding)."""
    if simulate is None or setting not in SEED_TOKENS_PER_STEP["dense"]:
        return None
    if simulate == SEED:
        return SEED_TOKENS_PER_STEP["moe" if is_moe else "dense"][setting]
    return float(simulate)


class SimulatedAcceptance:
    """Drafts kept per verify step so the running mean of committed tokens per step tracks ``target``.

    Step j keeps floor((j+1)(T-1)) - floor(j(T-1)) drafts (T-1 kept on average, one more emitted)."""

    def __init__(self, tokens_per_step: float):
        self.mean_kept, self.step = tokens_per_step - 1.0, 0

    def restart(self) -> None:
        """Back to step 0: the timed run then keeps what the warm-up kept, step for step, so it meets only
        shapes the warm-up met (a shape first seen in the timed run compiles or captures there)."""
        self.step = 0

    def __call__(self) -> int:
        j, m = self.step, self.mean_kept
        self.step += 1
        return math.floor((j + 1) * m + 1e-9) - math.floor(j * m + 1e-9)


class SimulatedVerifier:
    """``inner``'s verify, then every request keeps ``min(keep, k_b)`` drafts, ``keep`` set per step."""

    def __init__(self, inner: Verifier, schedule: SimulatedAcceptance, device: torch.device):
        self.inner, self.schedule = inner, schedule
        self.keep = torch.zeros((), dtype=torch.long, device=device)  # read by captured steps in place

    def next_step(self) -> None:
        """The next step's count, written to the device scalar (one small copy on the step's stream)."""
        self.keep.fill_(self.schedule())

    def __call__(self, logits: Tensor, proposal: DraftProposal, ks: Sequence[int] | Tensor, st: SamplingTensors,
                 anchor_positions: Tensor) -> VerifyOutput:
        real = self.inner(logits, proposal, ks, st, anchor_positions)
        drafts = proposal.tokens  # [B, k]
        if drafts.shape[1] == 0:
            return real
        if isinstance(ks, Tensor):  # a captured step's limits, on the device
            kept = torch.minimum(self.keep, ks)
        elif len(set(ks)) == 1:
            kept = self.keep.clamp(max=ks[0]).expand(drafts.shape[0])
        else:
            kept = torch.minimum(self.keep, torch.tensor(list(ks), device=drafts.device))
        # the correction token a real step emits after its kept drafts: here a draft token, as good as any
        return VerifyOutput(kept.clone(), torch.cat([drafts, drafts[:, :1]], dim=1))
