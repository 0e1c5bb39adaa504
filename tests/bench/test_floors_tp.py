"""The tensor-parallel floor of bench/floors.py: one rank's step bytes against a hand count of a tiny config's tensors
(split ones 1/tp, replicated ones whole, the rank's KV and GDN heads), the same bytes as the rank's actual shards by
fast/parallel/plan.py, tp=1 unchanged, and the collectives' ring bus bytes."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.bench.floors import (CollectiveBytes, expected_distinct_experts, target_step_bytes,
                                  tp_collective_bytes)
from dflash2.fast.parallel.plan import shard_spec, shard_tensor
from dflash2.reference.formats.config import parse_target_config
from dflash2.reference.formats.errors import ConfigError
from dflash2.reference.formats.weights import expected_target_shapes

C, V, H, HKV, D = 24, 102, 4, 2, 10  # hidden, vocab, query heads, KV heads, head dim: all split by 2
HK, HV, DK, DV, K = 2, 4, 6, 5, 4  # GDN key heads, value heads, head dims, conv taps
I, E, TOPK, MI, SI = 38, 7, 3, 10, 12  # dense intermediate; experts, top-k, expert and shared intermediates
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
S = 2  # bf16 bytes a value
SEQS, ROWS, CTX = 3, 4, 50  # sequences, rows each (a verify of k = 3), context


def config(moe: bool):
    text = {"vocab_size": V, "hidden_size": C, "num_hidden_layers": len(LAYERS), "layer_types": LAYERS,
            "num_attention_heads": H, "num_key_value_heads": HKV, "head_dim": D, "partial_rotary_factor": 0.4,
            "rope_theta": 1e4, "linear_num_key_heads": HK, "linear_num_value_heads": HV, "linear_key_head_dim": DK,
            "linear_value_head_dim": DV, "linear_conv_kernel_dim": K, "mtp_num_hidden_layers": 1}
    if moe:
        text.update(num_experts=E, num_experts_per_tok=TOPK, moe_intermediate_size=MI,
                    shared_expert_intermediate_size=SI)
    else:
        text["intermediate_size"] = I
    return parse_target_config({"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text})


def hand_rank_bytes(moe: bool, tp: int) -> tuple[float, float]:
    """(weights, caches) one of ``tp`` ranks moves, tensor by tensor: ``/ tp`` where plan.py splits it."""
    conv = 2 * HK * DK + HV * DV
    w = C + V * C / tp  # the final norm (replicated), the vocabulary-parallel LM head
    w += SEQS * ROWS * C / tp  # the embedding rows, each read by the rank holding it
    for kind in LAYERS:
        w += 2 * C  # input and post-attention norms: replicated
        if kind == "full_attention":
            w += (2 * H * D * C + 2 * HKV * D * C + C * H * D) / tp  # q|gate, k, v by heads; o by its columns
            w += 2 * D  # q_norm, k_norm: shared by the heads, replicated
        else:
            w += (conv * C + HV * DV * C + 2 * HV * C + conv * K + 2 * HV + C * HV * DV) / tp  # qkv z b a conv dt A out
            w += DV  # the output norm, shared by the value heads
        if moe:
            touched = expected_distinct_experts(E, TOPK, SEQS * ROWS) / E
            w += E * C  # the router: replicated
            w += touched * (E * 2 * MI * C + E * C * MI) / tp  # every expert, its I/tp slice
            w += (2 * SI * C + C * SI) / tp + C  # the shared expert split, its gate replicated
        else:
            w += 3 * I * C / tp
    kv = LAYERS.count("full_attention") * SEQS * CTX * 2 * (HKV // tp) * D * S
    gdn = LAYERS.count("linear_attention") * SEQS * 2 * (HV // tp) * DK * DV * 4
    return w * S, kv + gdn


def step(cfg, tp: int | None = None):
    kwargs = {} if tp is None else {"tp": tp}
    return target_step_bytes(cfg, S, num_seqs=SEQS, rows_per_seq=ROWS, context=CTX, **kwargs)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_one_ranks_bytes_are_the_hand_count(moe, tp):
    got = step(config(moe), tp)
    weights, caches = hand_rank_bytes(moe, tp)
    assert got.weights == pytest.approx(weights, rel=1e-12) and got.caches == pytest.approx(caches, rel=1e-12)


@pytest.mark.parametrize("moe", [False, True])
def test_tp1_is_the_floor_before_tensor_parallelism(moe):
    """The default is tp=1, and tp=1 divides by nothing: the same floats as before ``tp`` existed."""
    cfg = config(moe)
    assert step(cfg) == step(cfg, 1)
    assert step(cfg).caches == (2 * SEQS * CTX * 2 * HKV * D * S + 3 * SEQS * 2 * HV * DK * DV * 4)


@pytest.mark.parametrize("moe", [False, True])
def test_tp2_is_about_half_plus_the_replicated_parts(moe):
    """What tp=2 does not halve is exactly the replicated tensors (norms, router, shared expert gate)."""
    cfg = config(moe)
    one, two = step(cfg, 1), step(cfg, 2)
    replicated = sum(math.prod(shape) * S for name, shape in expected_target_shapes(cfg).items()
                     if not name.startswith("mtp.") and shard_spec(name, cfg).replicated)
    assert two.weights == pytest.approx(one.weights / 2 + replicated / 2, rel=1e-12)
    assert two.caches == one.caches / 2
    assert 0.5 < two.total / one.total < 0.6


@pytest.mark.parametrize("moe", [False, True])
def test_the_split_bytes_are_the_ranks_actual_shards(moe):
    """Every target tensor cut by plan.py's own shard_tensor: each rank's shard holds numel / tp of a split tensor
    and all of a replicated one, so summing the shards' bytes (the experts at the routing factor) gives the floor."""
    cfg, tp = config(moe), 2
    touched = expected_distinct_experts(E, TOPK, SEQS * ROWS) / E if moe else 1.0
    for rank in range(tp):
        total = SEQS * ROWS * C * S / tp  # the embedding rows
        for name, shape in expected_target_shapes(cfg).items():
            if name.startswith("mtp.") or name == "embed_tokens.weight":
                continue
            shard = shard_tensor(torch.empty(shape, dtype=torch.bfloat16), shard_spec(name, cfg), rank, tp)
            total += shard.numel() * S * (touched if "mlp.experts." in name else 1.0)
        assert step(cfg, tp).weights == pytest.approx(total, rel=1e-12)


def test_a_tp_the_heads_do_not_divide_is_refused():
    with pytest.raises(ConfigError, match=r"num_attention_heads=4: expected a multiple of .*tp=3"):
        step(config(False), 3)  # V = 102 is a multiple of 3, the 4 query heads are not


def test_the_collectives_ring_bus_bytes():
    """2 L + 1 all-reduces of rows x C x itemsize at 2 (N-1)/N, one all-gather of the fp32 logits at (N-1)/N."""
    cfg, rows = config(False), 12
    for tp in (2, 4):
        got = tp_collective_bytes(cfg, S, rows=rows, logit_rows=rows, tp=tp)
        assert got.all_reduce_message == rows * C * S and got.all_gather_message == rows * V * 4
        assert got.all_reduce == (2 * len(LAYERS) + 1) * rows * C * S * 2 * (tp - 1) / tp
        assert got.all_gather == rows * V * 4 * (tp - 1) / tp
    two = tp_collective_bytes(cfg, S, rows=rows, logit_rows=rows, tp=2)
    assert two.all_reduce == 11 * 12 * 24 * 2 and two.all_gather == 12 * 102 * 4 / 2  # the hand numbers at tp=2
    one = tp_collective_bytes(cfg, S, rows=rows, logit_rows=rows, tp=1)
    assert one.total == 0 and one.seconds(None) == 0.0  # tp=1: no term, no bandwidth asked for
    with pytest.raises(ValueError, match="tp=0"):
        tp_collective_bytes(cfg, S, rows=rows, logit_rows=rows, tp=0)


def test_the_collective_term_divides_each_by_the_bandwidth_at_its_message_size():
    comm = CollectiveBytes(all_reduce=3000.0, all_gather=500.0, all_reduce_message=100, all_gather_message=1000)
    busbw = {100: 1e3, 1000: 1e4}
    assert comm.seconds(busbw.__getitem__) == pytest.approx(3000 / 1e3 + 500 / 1e4)
