"""Greedy verification: the longest prefix matching the target's argmax, then its argmax."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2.reference.speculative.verify import VerifyResult, verify_greedy


def one_hot_logits(best: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits  # [k+1, V]


def test_all_accepted_emits_the_bonus():
    result = verify_greedy(torch.tensor([3, 1, 4]), one_hot_logits([3, 1, 4, 5]))
    assert result == VerifyResult(3, [3, 1, 4, 5]) and result.num_emitted == 4


def test_first_rejected_emits_the_correction_only():
    assert verify_greedy(torch.tensor([2, 1, 4]), one_hot_logits([3, 1, 4, 5])) == VerifyResult(0, [3])


def test_middle_mismatch():
    result = verify_greedy(torch.tensor([3, 1, 0, 2]), one_hot_logits([3, 1, 4, 2, 5]))
    assert result == VerifyResult(2, [3, 1, 4])


def test_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert verify_greedy(torch.tensor([2]), logits) == VerifyResult(0, [1])  # the higher tied id is rejected
    assert verify_greedy(torch.tensor([1]), logits) == VerifyResult(1, [1, 0])


def test_no_drafts_is_one_plain_greedy_token():
    assert verify_greedy(torch.tensor([], dtype=torch.long), one_hot_logits([4])) == VerifyResult(0, [4])


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"expected \[3, V\]"):
        verify_greedy(torch.tensor([1, 2]), one_hot_logits([1, 2]))


def toy_logits(prefix: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A fixed target: logits as a function of the prefix, with frequent ties  # [V]."""
    seed = 7
    for t in prefix:
        seed = seed * 31 + t + 1
    return torch.randint(0, 3, (vocab,), generator=torch.Generator().manual_seed(seed % 2**31)).float()


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), min_size=1, max_size=4), drafts=st.lists(st.integers(0, 4), max_size=7))
def test_greedy_verify_emits_what_plain_greedy_decoding_would(prompt, drafts):
    prefix = tuple(prompt)  # ends with the anchor t0
    rows = torch.stack([toy_logits(prefix + tuple(drafts[:i]), 5) for i in range(len(drafts) + 1)])
    result = verify_greedy(torch.tensor(drafts, dtype=torch.long), rows)
    plain = list(prefix)
    for _ in range(result.num_emitted):
        plain.append(int(torch.argmax(toy_logits(tuple(plain), 5))))
    assert result.emitted == plain[len(prefix):]
    assert result.emitted[:result.num_accepted] == drafts[:result.num_accepted]
    if result.num_accepted < len(drafts):  # the prefix is the longest: the next draft was wrong
        assert result.emitted[-1] != drafts[result.num_accepted]
