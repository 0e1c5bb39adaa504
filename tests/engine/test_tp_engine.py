"""The engine at tensor_parallel_size=2 (fast/engine/tp/workers.py start_workers) on the CPU over gloo: the same greedy tokens as
tp=1, the worker processes gone after ``close``, and the refusals (heads not divisible, GGUF target).

Rank 0 is this process (scheduler, sampling, its own shard); rank 1 is spawned and runs every eager forward rank 0
broadcasts. fp32 on both sides: the row-parallel sums only change their order, so greedy tokens must be equal.
"""

from __future__ import annotations

import gc

import pytest
import torch

from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.formats.errors import ConfigError
from dflash2.reference.tiny.target import write_tiny_target

# two prompts at once, one longer than a prefill chunk (max_num_batched_tokens 16) and crossing pages
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [(7 * i + 3) % 200 for i in range(37)]]
KWARGS = dict(dtype=torch.float32, device="cpu", max_running_req=2, max_num_batched_tokens=16, page_size=4,
              cpu_cache_bytes=8 << 20)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_tp2_gives_tp1_tokens_and_the_workers_exit(preset, tmp_path):
    path = write_tiny_target(tmp_path / "ckpt", preset, tokenizer=None)
    expected = greedy(LLM(path, **KWARGS))
    llm = LLM(path, tensor_parallel_size=2, **KWARGS)
    try:
        workers = llm.engine.workers.processes
        assert len(workers) == 1 and workers[0].is_alive()
        assert greedy(llm) == expected
        assert greedy(llm) == expected  # the slots and pages reused: the worker's pools mirror rank 0's
    finally:
        llm.close()
    assert not workers[0].is_alive() and workers[0].exitcode == 0
    llm.close()  # idempotent


def test_a_dropped_engine_stops_its_workers(tmp_path):
    path = write_tiny_target(tmp_path / "ckpt", "tiny-dense", tokenizer=None)
    llm = LLM(path, tensor_parallel_size=2, **KWARGS)
    workers = llm.engine.workers.processes
    del llm
    gc.collect()
    assert not workers[0].is_alive() and workers[0].exitcode == 0


def test_refusals(tmp_path):
    path = write_tiny_target(tmp_path / "ckpt", "tiny-dense", tokenizer=None)  # 2 KV heads
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2: expected a multiple of .*tp=4"):
        LLM(path, tensor_parallel_size=4, **KWARGS)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(model_path=str(path), tensor_parallel_size=0)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2: expected 1 with a GGUF target"):
        LLM(str(gguf), tensor_parallel_size=2, **KWARGS)


STARTUP = """
import sys, torch
from dflash2.fast.llm import LLM
from dflash2.reference.formats.errors import ConfigError
try:
    LLM(sys.argv[1], tensor_parallel_size=2, speculative_algorithm="mtp", dtype=torch.float32, device="cpu",
        max_running_req=2, page_size=4, max_num_batched_tokens=16, cpu_cache_bytes=int(sys.argv[2]),
        prefix_caching=False)
except ConfigError as e:
    print("ConfigError:", e)
"""


def test_a_budget_only_the_workers_fit_is_refused_not_hung(tmp_path):
    """Rank 0 holds more per token than a worker (the unsharded MTP layer's K/V): a cpu_cache_bytes with room for
    a worker's page and not for rank 0's must end in rank 0's ConfigError on every rank, not in a rank waiting for
    the others in a startup collective (run in a subprocess, so a hang fails the test instead of the lane)."""
    import subprocess
    import sys

    from dflash2.fast.parallel.plan import rank_config
    from dflash2.fast.model.pools import gdn_bytes_per_slot, kv_bytes_per_token, verify_bytes_per_seq
    from dflash2.reference.formats.checkpoint import target_config

    path = write_tiny_target(tmp_path / "ckpt", "tiny-dense", tokenizer=None)
    cfg = target_config(path)
    local = rank_config(cfg, 2)
    k = 3  # the MTP default
    slots = 2 * (gdn_bytes_per_slot(local, torch.float32) + verify_bytes_per_seq(local, torch.float32, k + 1))
    rank0_page = 4 * kv_bytes_per_token(local, torch.float32, True, mtp_cfg=cfg)
    worker_page = 4 * kv_bytes_per_token(local, torch.float32, False)
    assert worker_page < rank0_page
    budget = slots + (worker_page + rank0_page) // 2
    done = subprocess.run([sys.executable, "-c", STARTUP, str(path), str(budget)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ConfigError: cpu_cache_bytes" in done.stdout and f"({rank0_page} bytes each)" in done.stdout


def test_the_flag(tmp_path):
    import argparse

    from dflash2.fast.engine.config import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--tp", "2"]).tensor_parallel_size == 2
    assert parser.parse_args(["--tensor-parallel-size", "4"]).tensor_parallel_size == 4
    assert parser.parse_args([]).tensor_parallel_size == 1
