"""Sampling through ``ft generate`` is a pure function of the seed: same seed, same tokens; another
seed, other tokens; ``--n`` draws samples under derived seeds, each reproducible alone."""

from __future__ import annotations

import pytest

from dflash2.reference.request.rng import derive_seed

SAMPLING = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--max-tokens", "16", "--ignore-eos",
            "--json"]


def sample(ft, path, seed: int, *extra) -> dict:
    return ft("generate", "--model", path, "--prompt-ids", "5,17,42,99,3", *SAMPLING, "--seed", seed, *extra).json()


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_same_seed_same_tokens_other_seed_other_tokens(made, ft, preset):
    path = made(preset).target
    first, again = sample(ft, path, 11), sample(ft, path, 11)
    assert len(first["token_ids"]) == 16 and first["finish_reason"] == "length"
    assert first["token_ids"] == again["token_ids"] and first["text"] == again["text"]
    others = [sample(ft, path, seed)["token_ids"] for seed in (12, 2**40 + 11)]
    assert all(o != first["token_ids"] for o in others)
    assert others[0] != others[1]
    assert first["samples"][0]["seed"] == 11


def test_sampling_is_not_greedy(made, ft, greedy_args):
    path = made("tiny-dense").target
    greedy = ft(*greedy_args(path, max_tokens=16)).json()["token_ids"]
    sampled = [sample(ft, path, seed)["token_ids"] for seed in (1, 2, 3)]
    assert any(s != greedy for s in sampled)


def test_n_samples_use_distinct_derived_seeds_each_reproducible_alone(made, ft):
    path = made("tiny-dense").target
    out = sample(ft, path, 5, "--n", "3")
    samples = out["samples"]
    assert [s["index"] for s in samples] == [0, 1, 2]
    seeds = [s["seed"] for s in samples]
    assert seeds == [derive_seed(5, i) for i in range(3)]
    assert len(set(seeds)) == 3 and 5 not in seeds
    tokens = [s["token_ids"] for s in samples]
    assert all(len(t) == 16 for t in tokens)
    assert len({tuple(t) for t in tokens}) == 3
    assert out["token_ids"] == tokens[0]
    for seed, expected in zip(seeds, tokens):
        alone = sample(ft, path, seed)
        assert alone["token_ids"] == expected
        assert alone["samples"][0]["seed"] == seed


def test_n_samples_print_one_text_per_sample(made, ft):
    path = made("tiny-dense").target
    args = ["generate", "--model", path, "--prompt", "Hi", "--temperature", "0", "--max-tokens", "3", "--ignore-eos"]
    one = ft(*args)
    three = ft(*args, "--n", "3")
    assert one.code == three.code == 0
    assert three.out == one.out * 3  # greedy: the three samples agree, each printed on its own line
