"""The captured prefill steps (fast/engine/graphs/prefill_graphs.py) without the capture, on CPU: the keys' padding
arithmetic (every chunk layout that fits a key fills it with padding sequences of 1..Tq rows), the host fill, and
the engine's tokens through the static prefill path against the eager engine's, off / MTP / DFlash, dense and MoE,
with prefix-cache hits (a second turn resumes from a snapshot and prefills only its new rows on the graph path).

On CPU ``CapturedStep.replay`` runs the step function on the static fields, so everything but the capture runs
here (conformance/gpu/test_prefill_graphs_cuda.py captures and replays).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2.fast.engine.graphs.prefill_graphs import (PrefillGraphs, PrefillKey, field_sizes, fill_prefill,
                                                padding_lengths, prefill_key, row_buckets)
from dflash2.fast.engine.scheduler import pages_for
from dflash2.fast.engine.graphs.step_buffers import StaticInputs
from dflash2.fast.kernels.gdn.delta_rule import SHORT_PREFILL_ROWS
from dflash2.fast.llm import LLM, SamplingParams
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target


def test_row_buckets_and_keys():
    assert row_buckets(2048) == [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert row_buckets(100) == [64, 100] and row_buckets(40) == [40] and row_buckets(600) == [64, 128, 256, 512, 600]
    key = prefill_key(2048, max_seqs=8, pages=32)
    assert key.max_query_len == SHORT_PREFILL_ROWS and key.rows == 2048 + key.seqs and key.logits == 8
    with pytest.raises(ValueError, match="cannot fill"):
        padding_lengths(3, 4, 10)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_fitting_layout_fills_its_key(data):
    max_seqs = data.draw(st.integers(1, 16))
    max_rows = data.draw(st.sampled_from([16, 64, 100, 256, 512, 2048]))
    graphs = PrefillGraphs.__new__(PrefillGraphs)  # key_for's arithmetic alone
    graphs.max_seqs, graphs.max_rows = max_seqs, max_rows
    graphs.keys = [prefill_key(n, max_seqs=max_seqs, pages=4) for n in row_buckets(max_rows)]
    graphs.full = PrefillKey(max_rows, max_rows, 1, max_rows, 4, 1) if max_rows > SHORT_PREFILL_ROWS else None
    lengths = data.draw(st.lists(st.integers(1, max_rows), min_size=1, max_size=max_seqs))
    if data.draw(st.booleans()):
        lengths = [max_rows]  # one whole chunk
    key = graphs.key_for(lengths)
    if sum(lengths) > max_rows:
        assert key is None
        return
    if lengths == [max_rows] and max_rows > SHORT_PREFILL_ROWS:  # the unpadded key of one whole chunk
        assert key == graphs.full and padding_lengths(0, 0, max_rows) == []
        return
    smallest = next(k for k in graphs.keys if k.bucket >= sum(lengths))
    assert (key is None) == (max(lengths) > smallest.max_query_len)
    if key is None:
        return
    pads = padding_lengths(key.rows - sum(lengths), key.seqs - len(lengths), key.max_query_len)
    assert all(1 <= p <= key.max_query_len for p in pads) and sum(pads) + sum(lengths) == key.rows


def test_the_fill_puts_real_rows_first_and_padding_in_its_own_sequences():
    key = prefill_key(64, max_seqs=3, pages=4)
    inputs = StaticInputs(field_sizes(key), torch.device("cpu"))
    host = inputs.begin_fill()
    fill_prefill(host, key, starts=[32, 0], lengths=[5, 3], slots=[2, 0], tables=[[7, 1, 4], [3]],
                 tokens=list(range(10, 18)), logits_rows=[4, 7], page_size=16)
    cu = host.cu_seqlens
    assert list(cu[:3]) == [0, 5, 8] and cu[-1] == key.rows and np.all(np.diff(cu) >= 1)
    assert list(host.positions[:8]) == [32, 33, 34, 35, 36, 0, 1, 2]
    assert list(host.kv_slot_mapping[:8]) == [4 * 16 + 0, 4 * 16 + 1, 4 * 16 + 2, 4 * 16 + 3, 4 * 16 + 4,
                                              3 * 16, 3 * 16 + 1, 3 * 16 + 2]
    assert np.all(host.kv_slot_mapping[8:] == -1) and np.all(host.state_slots[2:] == -1)
    assert list(host.state_slots[:2]) == [2, 0] and list(host.context_lens[:2]) == [37, 3]
    assert np.all(host.context_lens[2:] == 0) and list(host.tokens[:8]) == list(range(10, 18))
    assert list(host.logits_rows) == [4, 7, 0]
    assert np.all(host.block_tables.reshape(key.seqs, 4)[2:] == -1)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    out = {}
    for name in ("tiny-dense", "tiny-moe"):
        root = tmp_path_factory.mktemp(name)
        target = write_tiny_target(root / "target", name, tokenizer=None)
        out[name] = target, write_tiny_draft(root / "draft", target)
    return out


# the MoE target for every proposer, the dense one with DFlash (the CPU lane's time: each case is two engines)
@pytest.mark.parametrize("name, algorithm", [("tiny-moe", "none"), ("tiny-moe", "mtp"), ("tiny-moe", "dflash"),
                                             ("tiny-dense", "dflash")])
def test_the_static_prefill_path_gives_the_eager_tokens(stacks, name, algorithm):
    target, draft = stacks[name]
    prompts = [[1, 2, 3], list(range(5, 30)), [9] * 7, list(range(40, 51)), [4, 4]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kwargs = dict(dtype=torch.float32, max_running_req=3, speculative_algorithm=algorithm, speculative_depth="fixed",
                  speculative_draft_model_path=draft if algorithm == "dflash" else None, snapshot_interval=16)
    eager_llm = LLM(target, **kwargs)
    static_llm = LLM(target, **kwargs)
    runner = static_llm.engine.runner
    runner.prefill_graphs = PrefillGraphs(runner.target, runner.pools, static_llm.engine.model.proposer, max_seqs=3,
                                          max_pages=pages_for(static_llm.engine.model.max_model_len, 16), max_rows=64)
    for turn in range(2):  # the second turn resumes each conversation from the prefix cache
        eager, static = eager_llm.generate(prompts, params), static_llm.generate(prompts, params)
        for a, b in zip(eager, static):
            assert a.error is None and b.error is None and a.token_ids == b.token_ids, (turn, a, b)
        prompts = [p + o.token_ids + [turn + 7] * 5 for p, o in zip(prompts, eager)]
    assert runner.prefill_graphs.replays >= 2
    assert static_llm.engine.prefix_cache.stats.hits > 0, "no second turn hit the prefix cache"
