"""(d) Rows a verify rejected are never read by a later draft forward.

After each verify the DFlash ring still holds K/V for the rejected rows (written before acceptance
was known). Poisoning exactly those rows with NaN must change nothing the draft does: every later
proposal (tokens and q) is bitwise the same as without poison. The planted-bug twin poisons the
last committed row instead, which the next anchor does read, and the proposals must change.
"""

from __future__ import annotations

import torch

from dflash2.reference.speculative.dflash import DFlashProposer
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.loop import speculative_generate

PROMPT = [5, 9, 31, 2, 77, 12, 40, 8, 3]


class PoisoningProposer(DFlashProposer):
    """Overwrites ring rows with NaN right after each observe: the rejected ones, or (planted bug) a committed one."""

    def __init__(self, draft, poison_committed: bool = False):
        super().__init__(draft)
        self.poison_committed = poison_committed
        self.poisoned = 0

    def observe(self, tokens, first_position, target_out, num_committed) -> None:
        super().observe(tokens, first_position, target_out, num_committed)
        if self.poison_committed:
            positions = [first_position + num_committed - 1]
        else:
            positions = list(range(first_position + num_committed, first_position + len(tokens)))
        for p in positions:
            self.ring.rows[p % self.ring.capacity] = float("nan")  # the tag still says p: only the data is bad
        self.poisoned += len(positions)


def proposals(stack, poison_committed: bool | None, params: SamplingParams):
    draft = stack.draft(5)
    proposer = DFlashProposer(draft) if poison_committed is None else PoisoningProposer(draft, poison_committed)
    result = speculative_generate(stack.target, proposer, PROMPT, params, 5)
    return proposer, [(s.draft_tokens, torch.tensor(s.draft_probs)) for s in result.steps]


def same(a, b) -> bool:
    return len(a) == len(b) and all(ta == tb and torch.equal(qa, qb) for (ta, qa), (tb, qb) in zip(a, b))


def test_poisoned_rejected_rows_change_nothing(stack):
    for params in (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=1.0, seed=4, ignore_eos=True)):
        clean = proposals(stack, None, params)[1]
        proposer, poisoned = proposals(stack, False, params)
        assert proposer.poisoned > 0, "the run must have rejected rows for this test to mean anything"
        assert same(clean, poisoned)


def test_planted_bug_poisoning_a_committed_row_is_seen(stack):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    clean = proposals(stack, None, params)[1]
    poisoned = proposals(stack, True, params)[1]
    assert not same(clean, poisoned)
