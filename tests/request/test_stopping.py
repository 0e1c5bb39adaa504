"""When a request ends (reference/request/stopping.py), the one rule both engines apply after every step."""

from __future__ import annotations

import pytest

from dflash2.reference.formats.errors import RequestError
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.request.stopping import Stopper


def decode(ids: list[int]) -> str:
    return "".join("abcdefghij"[i] for i in ids)


def test_a_stop_id_keeps_the_output_up_to_and_including_it():
    stopper = Stopper(SamplingParams(max_tokens=10), stop_token_ids=(9,))
    assert stopper.check([1, 2]) == ([1, 2], None)
    assert stopper.check([1, 2, 3, 9, 4]) == ([1, 2, 3, 9], "stop")


def test_ignore_eos_runs_to_max_tokens_and_cuts_a_longer_step():
    stopper = Stopper(SamplingParams(max_tokens=4, ignore_eos=True), stop_token_ids=(9,))
    assert stopper.check([9, 9, 9, 9, 9]) == ([9, 9, 9, 9], "length")


def test_an_engine_cap_overrides_max_tokens():
    assert Stopper(SamplingParams(max_tokens=10), max_tokens=3).check([1, 2, 3, 4]) == ([1, 2, 3], "length")


def test_a_stop_string_cuts_the_text_not_the_ids():
    stopper = Stopper(SamplingParams(max_tokens=10, stop=("cd",)), decode=decode)
    assert stopper.check([0, 1]) == ([0, 1], None)
    assert stopper.check([0, 1, 2, 3, 4]) == ([0, 1, 2, 3, 4], "stop")
    assert stopper.final_text([0, 1, 2, 3, 4]) == "ab"


def test_stop_strings_without_a_tokenizer_are_refused():
    with pytest.raises(RequestError, match="stop="):
        Stopper(SamplingParams(stop=("x",)))


def test_a_check_of_new_tokens_only_scans_them():
    """``checked``: the leading tokens an earlier check passed are not scanned again (the engine's per-step
    commit); the new ones are, and the cut and reason are the full scan's."""
    stopper = Stopper(SamplingParams(max_tokens=10), stop_token_ids=(9,))
    assert stopper.check([1, 2, 9, 4, 9], checked=3) == ([1, 2, 9, 4, 9], "stop")
    assert stopper.check([1, 2, 3, 9, 5], checked=3) == ([1, 2, 3, 9], "stop")
    assert stopper.check([1, 2, 3, 4], checked=2) == ([1, 2, 3, 4], None)
