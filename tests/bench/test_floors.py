"""The prefill FLOPs of bench/floors.py against a count of the forward's matrix products written out by hand
from the layer shapes, on tiny dense and MoE configs with odd sizes; the step bytes of quantized weights."""

from __future__ import annotations

import math

import pytest

from dflash2.bench.floors import GDN_CHUNK, prefill_flops, stored_bytes, target_step_bytes
from dflash2.reference.formats.config import load_target_config, parse_target_config

C, V, H, HKV, D = 24, 101, 3, 1, 10  # hidden, vocab, query heads, KV heads, head dim
HK, HV, DK, DV, K = 2, 4, 6, 5, 4  # GDN key heads, value heads, head dims, conv taps
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]


def config(moe: bool, num_experts: int = 7):
    text = {"vocab_size": V, "hidden_size": C, "num_hidden_layers": len(LAYERS), "layer_types": LAYERS,
            "num_attention_heads": H, "num_key_value_heads": HKV, "head_dim": D, "partial_rotary_factor": 0.4,
            "rope_theta": 1e4, "linear_num_key_heads": HK, "linear_num_value_heads": HV, "linear_key_head_dim": DK,
            "linear_value_head_dim": DV, "linear_conv_kernel_dim": K, "mtp_num_hidden_layers": 1}
    if moe:
        text.update(num_experts=num_experts, num_experts_per_tok=3, moe_intermediate_size=9,
                    shared_expert_intermediate_size=11)
    else:
        text["intermediate_size"] = 37
    return parse_target_config({"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text})


def mm(m: int, k: int, n: int) -> int:
    """FLOPs of an [m, k] @ [k, n] product."""
    return 2 * m * k * n


def hand_count(moe: bool, n: int, start: int, logits: int, num_experts: int = 7) -> float:
    """The prefill of rows start .. start + n - 1, product by product (n and start multiples of GDN_CHUNK where
    GDN layers chunk them)."""
    c = GDN_CHUNK
    total = mm(logits, C, V)  # LM head
    for kind in LAYERS:
        if kind == "full_attention":
            total += mm(n, C, 2 * H * D) + 2 * mm(n, C, HKV * D) + mm(n, H * D, C)  # q (with gate), k, v, o
            for pos in range(start, start + n):  # one query row over its causal keys, per head
                total += H * (mm(1, D, pos + 1) + mm(1, pos + 1, D))
        else:
            conv = 2 * HK * DK + HV * DV
            total += mm(n, C, conv) + mm(n, C, HV * DV) + 2 * mm(n, C, HV) + mm(n, HV * DV, C)  # qkv, z, b, a, out
            total += 2 * n * conv * K  # depthwise conv
            for _ in range(n // c):  # the chunked delta rule, per chunk and value head
                per_head = (mm(c, DK, c) + 2 * c ** 3 / 3 + mm(c, c, DK) + mm(c, c, DV)  # A, (I + A)^-1, W, U
                            + mm(c, DK, DV) + mm(DK, c, DV) + mm(c, DK, DV)  # W S, K^T V', Q S
                            + mm(c, DK, c) + mm(c, c, DV))  # Q K^T, its product with V'
                total += HV * per_head
        if moe:
            total += mm(n, C, num_experts) + 3 * (mm(n, C, 2 * 9) + mm(n, 9, C))  # router, 3 of the experts
            total += 2 * mm(n, C, 11) + mm(n, 11, C) + mm(n, C, 1)  # shared expert, its gate
        else:
            total += 2 * mm(n, C, 37) + mm(n, 37, C)
    return total


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("n, start, logits", [(128, 0, 1), (64, 192, 0), (192, 64, 1)])
def test_prefill_flops_count_every_product(moe, n, start, logits):
    assert prefill_flops(config(moe), n, start=start, logits_rows=logits) == pytest.approx(
        hand_count(moe, n, start, logits), rel=1e-12)


@pytest.mark.parametrize("moe", [False, True])
def test_a_prompts_chunks_sum_to_the_whole_prompt(moe):
    cfg = config(moe)
    chunks = [(0, 77, 0), (77, 100, 0), (177, 30, 1)]
    assert sum(prefill_flops(cfg, n, start=s, logits_rows=r) for s, n, r in chunks) == pytest.approx(
        prefill_flops(cfg, 207), rel=1e-12)


def test_an_moe_token_pays_for_its_top_k_experts_not_all():
    """More experts at the same top-k add only the router's rows."""
    n = 64
    extra = prefill_flops(config(True, num_experts=70), n) - prefill_flops(config(True, num_experts=7), n)
    assert extra == pytest.approx(len(LAYERS) * mm(n, C, 63), rel=1e-12)
    assert extra == pytest.approx(hand_count(True, n, 0, 1, 70) - hand_count(True, n, 0, 1, 7), rel=1e-12)


def test_quantized_weights_count_their_blocks_bytes():
    """--dummy-weight-type: a matrix kept as GGUF blocks costs its blocks' bytes (Q4_K: 144 bytes per 256 weights,
    IQ3_XXS: 98), the router, the conv and the vectors their dtype's."""
    cfg = load_target_config("bench/shapes/qwen3.5-35b-a3b")
    down = "layers.0.mlp.experts.down_proj"
    shape = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    assert stored_bytes(down, shape, 2, "Q4_K") == math.prod(shape) * 144 / 256
    assert stored_bytes(down, shape, 2, "IQ3_XXS") == math.prod(shape) * 98 / 256
    assert stored_bytes(down, shape, 2) == math.prod(shape) * 2
    router = ("layers.0.mlp.gate.weight", (cfg.num_experts, cfg.hidden_size))
    assert stored_bytes(*router, 2, "Q4_K") == math.prod(router[1]) * 2
    dense = target_step_bytes(cfg, 2, num_seqs=1, rows_per_seq=1, context=512)
    q4 = target_step_bytes(cfg, 2, num_seqs=1, rows_per_seq=1, context=512, weight_type="Q4_K")
    assert 0.25 < q4.weights / dense.weights < 0.3 and q4.caches == dense.caches  # ~4.5 of 16 bits
