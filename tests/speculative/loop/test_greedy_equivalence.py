"""(a) Greedy speculative decoding emits exactly the plain greedy tokens, for every proposer and k,
and the verifier keeps exactly the drafts it should (scripted drafts with known corruptions)."""

from __future__ import annotations

import pytest

from dflash2.reference.speculative.dflash import DFlashProposer
from dflash2.reference.generate import generate
from dflash2.reference.speculative.mtp import MTPProposer
from dflash2.reference.speculative.ngram import NgramProposer
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.speculative.loop import speculative_generate

from oracles import ScriptedProposer

PROMPT = [3, 17, 42, 8, 99, 5, 23, 61, 7, 11, 3, 17, 42]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def plain(stack) -> list[int]:
    return generate(stack.target, PROMPT, GREEDY).token_ids


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain(stack, k):
    spec = speculative_generate(stack.target, MTPProposer(stack.mtp), PROMPT, GREEDY, k)
    assert spec.token_ids == plain(stack)


@pytest.mark.parametrize("k", [1, 4, 7])
def test_dflash_greedy_equals_plain(stack, k):
    spec = speculative_generate(stack.target, DFlashProposer(stack.draft(k)), PROMPT, GREEDY, k)
    assert spec.token_ids == plain(stack)
    assert spec.steps[0].draft_tokens and len(spec.steps[0].draft_tokens) == k


def test_ngram_greedy_equals_plain(stack):
    spec = speculative_generate(stack.target, NgramProposer(), PROMPT, GREEDY, 4)
    assert spec.token_ids == plain(stack)


def test_scripted_drafts_accept_exactly_up_to_the_first_corruption(stack):
    reference = plain(stack)
    script = PROMPT + reference
    corrupt = {(len(PROMPT), 3), (len(PROMPT) + 3, 1)}  # first step keeps 2; the step at +3 keeps 0
    proposer = ScriptedProposer(script, corrupt, stack.target.cfg.vocab_size)
    spec = speculative_generate(stack.target, proposer, PROMPT, GREEDY, 4)
    assert spec.token_ids == reference
    by_anchor = {step.anchor_position: step.num_accepted for step in spec.steps}
    assert by_anchor[len(PROMPT)] == 2
    assert by_anchor[len(PROMPT) + 3] == 0
    # every other step had a perfect script: all k drafts (or what the budget allows) kept
    for step in spec.steps:
        if step.anchor_position not in (len(PROMPT), len(PROMPT) + 3):
            assert step.num_accepted == len(step.draft_tokens)
            assert len(step.emitted) == step.num_accepted + 1
