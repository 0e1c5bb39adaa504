"""When a captured speculative step may launch the next step's proposal before it returns (``StepGraphs``).

A split step (a proposer that reads no block table: DFlash) ends its graphs by advancing its proposal fields as
the host will for the next step: each real request's anchor moves past its committed tokens and its anchor
token becomes the last of them. The step can then launch the next step's proposal on those fields right
behind its own graphs, before the host reads its result, so the GPU drafts step n + 1 while the host commits
step n and fills the rest of the next batch.

That proposal is used only if nothing can have changed what it read: the next step asks for the same key and
exactly the advanced fields, no graph of the pool replayed since, and no other runner step ran in between (a
prefill, a decode or an eager verify could write the rings it read). A DFlash proposal writes no state, so one
nobody uses costs only its GPU time; the policy bounds that waste by launching only while the prediction held
for at least ``min_hits`` of the last ``window`` steps (checked on every step, launched or not): a batch whose
requests finish or join often stops paying for proposals it drops, and takes them up again once it is steady.
The rule and its thresholds were measured on the MoE shape (bench/results/2026-12-03-h200-perf11/).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Prediction:
    """What the next step must ask for to use a proposal launched ahead."""

    key: object  # the GraphKey
    pool_replays: int  # replays of the graph pool when it was made
    epoch: int  # the runner's step count when it was made
    fields: tuple  # the advanced proposal fields: (anchors, anchor tokens, slots, sampling parameters)


class ProposeAhead:
    """The policy of the module docstring. ``enabled`` False (``EngineConfig.propose_ahead``): never launch."""

    def __init__(self, enabled: bool = True, window: int = 8, min_hits: int = 6):
        self.enabled, self.window, self.min_hits = enabled, window, min_hits
        self.expected: Prediction | None = None
        self.launched = False  # whether the last step launched the proposal for ``expected``
        self.recent_hits: deque[bool] = deque(maxlen=window)
        self.used = 0  # steps whose proposal the step before had launched (tests, diagnostics)

    def claim(self, key, pool_replays: int, epoch: int, fields: tuple) -> bool:
        """Whether this step (the runner's ``epoch``) finds its proposal already launched; records whether
        the prediction held, and forgets it (one step uses it at most)."""
        hit = self.expected == Prediction(key, pool_replays, epoch - 1, fields)
        if self.expected is not None:
            self.recent_hits.append(hit)
        ready = hit and self.launched
        self.used += ready
        self.expected, self.launched = None, False
        return ready

    def should_launch(self, requested: bool) -> bool:
        """Whether this step launches the next one's proposal: the caller expects the same requests to go on
        (``requested``) and the prediction has been holding."""
        return requested and self.enabled and self.recent_hits.count(False) <= self.window - self.min_hits

    def forget(self) -> None:
        """Expect nothing (the step's proposal fields are no longer what a prediction would say)."""
        self.expected, self.launched = None, False

    def expect(self, prediction: Prediction, launched: bool) -> None:
        """The next step's expected fields, and whether their proposal was launched."""
        self.expected, self.launched = prediction, launched
