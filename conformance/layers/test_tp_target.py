"""Tensor-parallel fast target (fast/parallel/) vs the same target at tp=1, CPU lane over gloo.

A tiny checkpoint is run through the greedy steps of ``tp_harness.greedy_steps`` (a prefill of two
prompts, decode steps, a verify step and its commit, decode again) once at tp=1 in this process and once
by ``tp`` spawned ranks, each holding its shard. Every rank must return the same logits, hidden and taps
bit for bit (the all-reduce and the all-gather hand every rank the same sums), and they are compared
with tp=1 as NUMERIC fp32 (docs/tolerances.md: rms-relative <= 1e-5): both runs are fp32 and compute
the same values, only the order of the sums inside each row-parallel projection changes (tp partial
dot products of K/tp terms, then summed by the all-reduce). The greedy tokens must be identical (EXACT).

tiny-dense and tiny-moe have 2 KV heads and 2 GDN key heads, so they run at tp=2 only; a variant of each
with every split count divisible by 4 runs at tp=4.
"""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from dflash2.fast.parallel import rank_config
from dflash2.reference.formats.errors import ConfigError
from dflash2.reference.formats.checkpoint import load_target
from dflash2.reference.tiny.target import PRESETS, write_tiny_target
from fast_model_harness import BOUNDS, REPORT, ErrorLog
from tp_harness import build, greedy_steps, rank_main

# heads divisible by 4 (H 8, Hkv 4, Hk 4, Hv 8); the widths 72 (dense I), 20 and 28 (MoE) and V 512 already are
WIDE_HEADS = dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
CASES = [("tiny-dense", 2), ("tiny-moe", 2), ("tiny-dense-wide", 4), ("tiny-moe-wide", 4)]


def spec_of(name: str):
    if name.endswith("-wide"):
        return replace(PRESETS[name.removesuffix("-wide")], **WIDE_HEADS)
    return PRESETS[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name,tp", CASES)
def test_tp_matches_tp1(name, tp, tmp_path):
    path = write_tiny_target(tmp_path / "ckpt", spec_of(name), tokenizer=None)
    expected = greedy_steps(build(path))
    mp.spawn(rank_main, args=(tp, free_port(), str(path), str(tmp_path)), nprocs=tp, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]

    for r, other in enumerate(ranks[1:], start=1):  # every rank holds the same full outputs
        for key in ("logits", "hidden", "taps", "tokens"):
            for step, (a, b) in enumerate(zip(ranks[0][key], other[key])):
                assert torch.equal(a, b), f"{name} tp={tp}: rank {r} {key} differs from rank 0's at step {step}"

    got = ranks[0]
    assert [t.tolist() for t in got["tokens"]] == [t.tolist() for t in expected["tokens"]], \
        f"{name} tp={tp}: greedy tokens differ from tp=1"
    log = ErrorLog(f"tp={tp} vs tp=1 {name}", BOUNDS[torch.float32])
    for key in ("logits", "hidden", "taps"):
        for step, (a, b) in enumerate(zip(got[key], expected[key])):
            error = log.add(key, a, b)
            assert error <= log.bound, f"{name} tp={tp} {key} step {step}: rms-rel {error:.2e} > {log.bound:.0e}"
    REPORT.append(log)


def test_indivisible_heads_refused(tmp_path):
    cfg, _ = load_target(write_tiny_target(tmp_path, "tiny-dense", tokenizer=None))
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2: expected a multiple of .*tp=4"):
        rank_config(cfg, 4)
    assert rank_config(cfg, 1) is cfg
