"""Streamed text (``fast/serve/detokenize.py``): what is sent is always a prefix of the engine's final
text, whatever the chunking, the stop strings and split UTF-8 characters; with the stop-string hold
back removed, the same cases fail (the check can fail)."""

from __future__ import annotations

import random

import pytest

from dflash2.fast.serve import detokenize
from dflash2.fast.serve.detokenize import IncrementalText, TokenStrings, held_back
from dflash2.reference.formats.tokenizer import load_tokenizer
from dflash2.reference.request.sampling_params import SamplingParams
from dflash2.reference.request.stopping import Stopper


def test_held_back_is_the_longest_suffix_starting_a_stop_string():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello world", ["world"]) == 0  # a whole stop string is the engine's to cut
    assert held_back("abcab", ["abx", "cabz"]) == 3
    assert held_back("xyz", ["a"]) == 0 and held_back("", ["ab"]) == 0 and held_back("a", []) == 0


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny.target)


def stream(tokenizer, token_ids: list[int], stops: tuple[str, ...], rng: random.Random) -> tuple[str, str]:
    """(the concatenated stream, the engine's final text), feeding tokens in random steps as the
    engine commits them, stopping where the reference's Stopper stops."""
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    stopper = Stopper(SamplingParams(max_tokens=len(token_ids), stop=stops, ignore_eos=True), (), decode)
    text, out, output = IncrementalText(decode, stops), "", []
    i = 0
    while True:
        step = token_ids[i:i + rng.randint(1, 4)]
        i += len(step)
        output, reason = stopper.check(output + step)
        if reason is not None:
            return out + text.finish(stopper.final_text(output)), stopper.final_text(output)
        out += text.add(step)


def test_the_stream_is_the_final_text_for_random_outputs_and_stops(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer.get_vocab())
    hits = 0
    for case in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stops = ()
        if full and case % 3:  # a stop string from the text itself (so it hits), sometimes one that never does
            start = rng.randrange(len(full))
            stops = (full[start:start + rng.randint(1, 4)], "\u2603never")
        streamed, final = stream(tokenizer, ids, stops, rng)
        assert streamed == final, (ids, stops)
        hits += bool(stops) and len(final) < len(full)
    assert hits > 50  # the stop strings did cut the text


def test_without_the_hold_back_the_stream_leaks_a_stop_strings_start(tokenizer, monkeypatch):
    monkeypatch.setattr(detokenize, "held_back", lambda text, stops: 0)
    rng = random.Random(0)
    vocab = len(tokenizer.get_vocab())
    broken = 0
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        if len(full) < 4:
            continue
        start = rng.randrange(len(full) - 3)
        streamed, final = stream(tokenizer, ids, (full[start:start + 4],), rng)
        broken += streamed != final
    assert broken > 0


def test_a_split_utf8_character_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("caf\u00e9 \u4e2d\u6587", add_special_tokens=False)
    assert len(tokenizer.encode("\u4e2d", add_special_tokens=False)) == 3  # one byte per token here
    pieces = IncrementalText(lambda t: tokenizer.decode(t, skip_special_tokens=True))
    sent = [pieces.add([t]) for t in ids]
    assert "".join(sent) == "caf\u00e9 \u4e2d\u6587" and all("\ufffd" not in s for s in sent)


def test_token_strings_keep_the_bytes_of_a_partial_character(tokenizer):
    strings = TokenStrings(tokenizer)
    ids = tokenizer.encode("\u4e2d", add_special_tokens=False)
    assert all(strings(t)[0] == "\ufffd" for t in ids)  # no token is a character on its own
    raw = b"".join(bytes(strings(t)[1]) for t in ids)
    assert raw.decode("utf-8") == "\u4e2d"
    assert TokenStrings(None)(7) == ("token_id:7", list(b"token_id:7"))
