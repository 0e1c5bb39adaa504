"""EngineConfig (validation, argparse defaults from the dataclass, auto device and dtype) and the cache
sizing of memory.py, whose byte counts must equal what the pools really allocate."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

import pytest
import torch

from dflash2.fast.engine.config import ENGINE_FLAGS, EngineConfig, add_engine_args, engine_config_from_args
from dflash2.fast.engine.memory import (dflash_slot_bytes, dflash_workspace_bytes, log_plan, plan_memory,
                                       rebuild_group, snapshot_count)
from dflash2.fast.model.pools import CachePools, gdn_bytes_per_slot, kv_bytes_per_token
from dflash2.fast.speculative.ring import RingPool, WindowPool
from dflash2.reference.formats.draft_config import parse_draft_config
from dflash2.reference.tiny.draft import tiny_draft_config
from dflash2.reference.formats.errors import ConfigError
from dflash2.reference.tiny.target import tiny_target_config


def test_argparse_defaults_are_the_dataclass_defaults():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    assert {name: getattr(args, name) for name in ENGINE_FLAGS} == {name: defaults[name] for name in ENGINE_FLAGS}
    args = parser.parse_args(["--max-running-req", "3", "--memory-ratio", "0.5", "--max-model-len", "64"])
    for name, value in dict(model="m", speculative_algorithm="none", speculative_draft_model_path=None,
                            speculative_num_steps=None).items():
        setattr(args, name, value)
    config = engine_config_from_args(args)
    assert (config.max_running_req, config.memory_ratio, config.max_model_len) == (3, 0.5, 64)


def test_overlap_scheduling_is_on_and_sglangs_flag_turns_it_off():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).overlap_schedule is True
    assert parser.parse_args(["--disable-overlap-schedule"]).overlap_schedule is False
    assert parser.parse_args(["--no-overlap-schedule"]).overlap_schedule is False
    assert EngineConfig(model_path="m").speculative_depth == "adaptive"  # the depth is chosen per step by default


def test_auto_resolves_to_the_machine():
    config = EngineConfig(model_path="m").resolved()
    if torch.cuda.is_available():
        assert (config.device, config.dtype) == ("cuda", "bfloat16")
    else:
        assert (config.device, config.dtype, config.torch_dtype) == ("cpu", "float32", torch.float32)
    assert EngineConfig(model_path="m", dtype=torch.bfloat16).dtype == "bfloat16"
    assert EngineConfig(model_path="m", dtype="fp16", device="cpu").resolved().torch_dtype == torch.float16


@pytest.mark.parametrize("kw, needle", [
    (dict(model_path=""), "model_path=''"),
    (dict(speculative_algorithm="eagle"), "speculative_algorithm='eagle': expected one of"),
    (dict(speculative_draft_model_path="d"), "only used with speculative_algorithm 'dflash'"),
    (dict(speculative_num_steps=2), "speculative_num_steps=2: only used with"),
    (dict(speculative_algorithm="mtp", speculative_num_steps="3"), "speculative_num_steps='3'"),
    (dict(dtype=torch.int8), "dtype=torch.int8"),
    (dict(snapshot_interval=24), "snapshot_interval=24: expected None or a positive multiple of page_size (16)"),
    (dict(snapshot_interval=0), "snapshot_interval=0"),
    (dict(prefix_snapshots=0), "prefix_snapshots=0: expected None (automatic) or an integer >= 1"),
    (dict(prefix_caching="yes"), "prefix_caching='yes': expected a bool"),
])
def test_config_refusals_name_field_value_and_expectation(kw, needle):
    with pytest.raises(ConfigError) as exc:
        EngineConfig(**{"model_path": "m", **kw})
    assert needle in str(exc.value)


def test_plan_puts_slots_first_then_pages_capped_by_what_requests_can_use():
    plan = plan_memory(10_000, page_size=4, num_slots=2, max_model_len=1000, kv_bytes_per_token=10,
                       state_bytes_per_slot=1000, draft_bytes_per_slot=500)
    assert plan.num_pages == (10_000 - 3000) // 40 and plan.kv_tokens == 175 * 4
    assert plan.total_bytes <= 10_000
    capped = plan_memory(10**9, page_size=4, num_slots=2, max_model_len=10, kv_bytes_per_token=10,
                         state_bytes_per_slot=0)
    assert capped.num_pages == 2 * 3  # two requests of 10 tokens: 3 pages each
    assert capped.budget_pages == 10**9 // 40 and plan.budget_pages == plan.num_pages  # what the budget holds uncapped
    with pytest.raises(ConfigError, match="cpu_cache_bytes: the cache budget of .* no KV page .* 0.0 MiB short"):
        plan_memory(3039, page_size=4, num_slots=2, max_model_len=10, kv_bytes_per_token=10,
                    state_bytes_per_slot=1000, draft_bytes_per_slot=500, budget_field="cpu_cache_bytes")
    with pytest.raises(ConfigError, match=r"10.4 MiB short of one: expected memory_ratio raised by at least that "
                                          r"\(\+0.010 of the device's memory\)"):
        plan_memory(-(10 << 20), page_size=4, num_slots=2, max_model_len=10, kv_bytes_per_token=10**5,
                    state_bytes_per_slot=0, device_total_bytes=1 << 30)


def test_byte_counts_equal_the_allocated_pools(caplog):
    cfg = tiny_target_config("tiny-dense")
    draft_cfg = parse_draft_config(tiny_draft_config(cfg, sliding_window=40), cfg)
    pools = CachePools(cfg, num_pages=5, page_size=4, num_slots=3, max_verify_rows=1, dtype=torch.float32,
                       device="cpu", mtp=True)
    kv = sum(t.numel() * t.element_size() for layer in [*pools.attention.values(), pools.mtp]
             for t in (layer.keys, layer.values))
    assert kv == pools.num_kv_slots * kv_bytes_per_token(cfg, torch.float32, True)
    state = sum(t.numel() * t.element_size() for slots in pools.gdn.values() for t in (slots.conv, slots.recurrent))
    assert state == 3 * gdn_bytes_per_slot(cfg, torch.float32)
    ring = RingPool(3, draft_cfg.sliding_window, draft_cfg.num_hidden_layers, draft_cfg.num_key_value_heads,
                    draft_cfg.head_dim)
    window = WindowPool(3, draft_cfg.sliding_window, draft_cfg.hidden_size)
    ring_bytes, window_bytes = dflash_slot_bytes(draft_cfg, torch.float32)
    per_slot = lambda *ts: sum(t[:3].numel() * t.element_size() for t in ts) // 3  # noqa: E731 (no trash slot)
    assert ring_bytes == per_slot(ring.k.transpose(0, 1), ring.v.transpose(0, 1), ring.tags)
    assert window_bytes == per_slot(window.rows, window.tags)
    plan = plan_memory(1 << 20, page_size=4, num_slots=3, max_model_len=64,
                       kv_bytes_per_token=kv_bytes_per_token(cfg, torch.float32, False),
                       state_bytes_per_slot=gdn_bytes_per_slot(cfg, torch.float32),
                       draft_bytes_per_slot=ring_bytes + window_bytes)
    with caplog.at_level(logging.INFO, logger="dflash2.fast.engine"):
        log_plan(plan, draft_ring_bytes=ring_bytes, draft_window_bytes=window_bytes)
    assert f"KV cache: {plan.kv_tokens} tokens" in caplog.text
    assert "DFlash draft per slot" in caplog.text and "dflash_window" in caplog.text
    # a snapshot slot: the GDN state (snapshots.py) and the saved window, as startup counts it
    from dflash2.fast.engine.snapshots import StateSnapshots
    saved = WindowPool(3, draft_cfg.sliding_window, draft_cfg.hidden_size, num_saved=2)
    snapshots = StateSnapshots(pools, None, 2)
    nbytes = sum(t.numel() * t.element_size() for t in (snapshots.conv, snapshots.recurrent, saved.saved_rows,
                                                         saved.saved_tags))
    assert nbytes == 2 * (gdn_bytes_per_slot(cfg, torch.float32) + window_bytes)


@pytest.mark.parametrize("rows, expected_group", [(37, 1), (100, 2), (200, 3)])  # W - 1 = 39 rows a ring, 3 slots
def test_the_draft_workspace_covers_a_prefill_chunk_and_a_group_of_ring_rebuilds(rows, expected_group):
    """The plan sets aside what the draft's own temporaries take: the tapped features, context rows and
    context K/V of a whole prefill chunk, or one group of ring rebuilds (the tensors, as allocated): as many
    rings as a chunk's rows cover, at least one, so the workspace does not grow with the slots."""
    from dflash2.fast.model.draft import FastDraft
    from dflash2.reference.tiny.dummy import dummy_draft_weights

    cfg = tiny_target_config("tiny-dense")
    draft_cfg = parse_draft_config(tiny_draft_config(cfg, sliding_window=40), cfg)
    embed = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    draft = FastDraft(draft_cfg, dummy_draft_weights(draft_cfg, dtype=torch.float32), embed, embed, torch.float32, "cpu")
    slots = 3
    group = min(slots, rebuild_group(draft_cfg, rows))
    assert group == expected_group
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    features = torch.randn(rows, draft_cfg.num_taps * cfg.hidden_size)
    context = draft.context_rows(features)
    k, v = draft.context_kv(context, torch.arange(rows))
    prefill = nbytes(features, context, k, v)
    window_rows = torch.randn(group * (draft_cfg.sliding_window - 1), cfg.hidden_size)
    rk, rv = draft.context_kv(window_rows, torch.arange(window_rows.shape[0]))
    rebuild = nbytes(window_rows, rk, rv)
    workspace = dflash_workspace_bytes(draft_cfg, torch.float32, max_num_batched_tokens=rows, num_slots=slots)
    assert workspace == max(prefill, rebuild)
    plan = plan_memory(1 << 20, page_size=4, num_slots=slots, max_model_len=10**6, kv_bytes_per_token=64,
                       state_bytes_per_slot=100, workspace_bytes=workspace)
    assert plan.total_bytes <= 1 << 20 and plan.workspace_bytes == workspace
    assert plan.num_pages == ((1 << 20) - slots * 100 - workspace) // (4 * 64)


def test_snapshot_slots_come_out_of_the_budget_left_for_pages():
    """Automatic snapshot slots: up to 4 per request slot within 15% of what the running slots leave, none when
    not one fits; an explicit count is kept; the plan then takes them out before the pages."""
    assert snapshot_count(None, free_bytes=10_000, snapshot_bytes=100, num_slots=2) == 8  # the per-slot cap
    assert snapshot_count(None, free_bytes=2_000, snapshot_bytes=100, num_slots=2) == 3  # 15% of 2000 = 300
    assert snapshot_count(None, free_bytes=600, snapshot_bytes=100, num_slots=2) == 0
    assert snapshot_count(5, free_bytes=0, snapshot_bytes=100, num_slots=2) == 5
    plain = plan_memory(100_000, page_size=4, num_slots=2, max_model_len=10**6, kv_bytes_per_token=10,
                        state_bytes_per_slot=100)
    cached = plan_memory(100_000, page_size=4, num_slots=2, max_model_len=10**6, kv_bytes_per_token=10,
                         state_bytes_per_slot=100, num_snapshots=3, snapshot_bytes=1000)
    assert cached.num_snapshots == 3 and cached.num_pages == plain.num_pages - 3000 // 40
    assert cached.total_bytes <= 100_000
    assert EngineConfig(model_path="m").prefix_snapshot_interval == 2048  # max_num_batched_tokens
    assert EngineConfig(model_path="m", max_num_batched_tokens=1000).prefix_snapshot_interval == 992


def test_large_dummy_tensors_are_drawn_a_slice_at_a_time_into_their_buffer(monkeypatch):
    """A dummy tensor past CHUNK_BYTES (fp32) is drawn a first-axis slice at a time, straight into its buffer in
    the model dtype (reference/tiny/dummy.py): ``fill`` into a slice of a larger buffer and a read give the same
    values; small tensors keep their one-draw values; FastMoE writes its experts into the fused [E + 1, ...]
    buffer in place and equals the stacked tensors."""
    import dflash2.reference.tiny.dummy as dummy
    from dflash2.fast.model.moe import FastMoE
    from dflash2.fast.model.params import Params

    from dataclasses import replace

    moe_cfg = tiny_target_config("tiny-moe")  # with the shared expert as wide as a routed one, as released
    cfg = replace(moe_cfg, shared_expert_intermediate_size=moe_cfg.moe_intermediate_size)
    small = dummy.dummy_target_weights(cfg, seed=3, dtype=torch.bfloat16)
    name = "layers.0.mlp.experts.gate_up_proj"
    whole = small[name]
    monkeypatch.setattr(dummy, "CHUNK_BYTES", whole.numel() * 4 // 3)  # three slices of the expert axis
    sliced = dummy.dummy_target_weights(cfg, seed=3, dtype=torch.bfloat16)
    read = sliced[name]
    assert read.dtype == torch.bfloat16 and read.shape == whole.shape and not torch.equal(read, whole)
    out = torch.zeros((whole.shape[0] + 1, *whole.shape[1:]), dtype=torch.bfloat16)
    sliced.fill(name, out[:-1])
    assert torch.equal(out[:-1], read) and not out[-1].any()
    moe = FastMoE(cfg, Params(cfg, sliced, torch.bfloat16, "cpu"), "layers.0.")
    assert moe.shared_as_expert and torch.equal(moe.gate_up, read)
    assert torch.equal(sliced["layers.0.mlp.gate.weight"], small["layers.0.mlp.gate.weight"])  # small: one draw


def test_cuda_budget_counts_the_allocators_unused_cache_as_free(monkeypatch):
    """Memory the caching allocator holds for no tensor (a load's freed temporaries) is budget for the caches:
    budget = free + (reserved - allocated) - total * (1 - memory_ratio)."""
    from dflash2.fast.engine import memory

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 57 * gib)
    config = EngineConfig(model_path="m", memory_ratio=0.9)
    assert memory.cache_budget_bytes(config, torch.device("cuda")) == int(6 * gib + 3 * gib - 80 * gib * 0.1)


def test_the_profiling_forward_runs_a_full_chunk_and_reports_the_peak_over_its_level(monkeypatch):
    """memory.forward_peak_bytes builds a one-sequence prefill of ``rows`` rows over throw-away pools and
    returns the allocator's peak above its level before the forward (the CUDA counters are faked here; the forward
    itself runs, so the batch it builds must be a valid prefill)."""
    from dflash2.fast.engine import memory
    from dflash2.fast.model.target import FastTarget
    from dflash2.reference.tiny.dummy import dummy_target_weights

    counters = {"level": 1000, "peak": 0, "forwards": 0, "rows": []}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["level"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["level"] + counters["peak"])
    cfg = tiny_target_config("tiny-moe")
    target = FastTarget(cfg, dummy_target_weights(cfg, seed=0, dtype=torch.float32, device="cpu"), torch.float32, "cpu")
    forward = target.forward

    def counted(batch, pools, on_taps=None):
        counters["forwards"] += 1
        counters["rows"].append(batch.token_ids.shape[0])
        counters["peak"] = 100 * batch.token_ids.shape[0]  # as if each row's temporaries took 100 bytes
        out = forward(batch, pools, on_taps)
        assert out.logits.shape == (1, cfg.vocab_size) and torch.isfinite(out.logits).all()
        return out

    target.forward = counted
    assert memory.forward_peak_bytes(target, 37, page_size=16, max_verify_rows=4) == 3700
    prefill, graphs = memory.activation_bytes(target, max_num_batched_tokens=64, max_step_rows=12,
                                                      graph_pools=2, page_size=16, max_verify_rows=4)
    assert (prefill, graphs) == (6400, 2 * 1200) and counters["rows"] == [37, 64, 12]
    assert memory.activation_bytes(target, max_num_batched_tokens=64, max_step_rows=12, graph_pools=0,
                                           page_size=16, max_verify_rows=4) == (6400, 0)


def test_a_refusal_names_the_activations_kept_out():
    with pytest.raises(ConfigError, match=r"after 3\.0 MiB of prefill activations and 1\.0 MiB for CUDA graphs"):
        plan_memory(1 << 20, page_size=16, num_slots=2, max_model_len=64, kv_bytes_per_token=1024,
                    state_bytes_per_slot=1 << 20, activation_bytes=3 << 20, graph_pool_bytes=1 << 20)
