"""The Triton kernels against their torch twins at the released models' shapes, on CUDA.

The twins themselves are held to the reference at small odd shapes in the other op tests; here
the question is whether the kernels stay exact (indices, tokens) and within NUMERIC (values) at
V = 248320, K_sel = 16, r = 256, C = 5120, W = 2048 (capacity 2112), 32/8 heads of 128, k = 7.
Token comparisons skip requests whose decision lies within 1e-4 of a threshold in either twin
(none expected at these scales; the count is asserted small).
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.kernels.attention.attention_prologue import draft_qk_norm_rope_triton
from dflash2.fast.kernels.draft.dynamic_conv import grouped_dynamic_conv_torch, grouped_dynamic_conv_triton
from dflash2.fast.kernels.gdn.gdn_commit import commit_verify_torch, commit_verify_triton
from dflash2.fast.kernels.gdn.gdn_recurrent import VerifyRowInputs, gated_delta_rule_verify_triton
from dflash2.fast.kernels.sampling.philox import keyed_uniform_torch, keyed_uniform_triton
from dflash2.fast.kernels.sampling.rejection import verify_torch, verify_triton
from dflash2.fast.kernels.draft.ring_attention import ring_attention_torch, ring_attention_triton
from dflash2.fast.kernels.sampling.sampler import SamplingTensors, sample_torch, sample_triton, target_probs_torch
from dflash2.fast.kernels.sampling.sampler import target_probs_triton
from dflash2.fast.kernels.draft.selector import select_torch, select_triton
from dflash2.fast.kernels.attention.attention_prologue import draft_qk_norm_rope_torch
from dflash2.fast.kernels.attention.rope import rope_cos_sin
from dflash2.reference.request.rng import Purpose
from dflash2.reference.request.sampling_params import SamplingParams

# the CPU lane deselects these (scripts/test.sh: -m "not gpu"); the GPU lane runs them
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes run in the GPU lane")]

V, K_SEL, RANK, HIDDEN, BLOCK, K = 248320, 16, 256, 5120, 8, 7


def rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-30))


def params(batch: int) -> list[SamplingParams]:
    kinds = [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95, top_k=20), dict(temperature=0.7),
             dict(temperature=1.0, top_p=0.8)]
    return [SamplingParams(seed=1000 + b, **kinds[b % len(kinds)]) for b in range(batch)]


def test_philox_bit_identical_on_a_million_keys():
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 1 << 20
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), device="cuda", generator=gen)
    positions = torch.randint(0, 2**31, (n,), device="cuda", generator=gen)
    slots = torch.randint(0, 16, (n,), device="cuda", generator=gen)
    a = keyed_uniform_triton(seeds, positions, int(Purpose.ACCEPT), slots)
    b = keyed_uniform_torch(seeds, positions, int(Purpose.ACCEPT), slots)
    assert torch.equal(a, b)


def test_sampler_at_full_vocabulary():
    batch = 16
    st = SamplingTensors.from_params(params(batch), device="cuda")
    logits = torch.randn(batch, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) * 3
    probs_tri, probs_ref = target_probs_triton(logits, st), target_probs_torch(logits, st)
    assert rms_rel(probs_tri, probs_ref) < 1e-5
    positions = torch.arange(batch, device="cuda") + 100
    assert torch.equal(sample_triton(logits, st, positions), sample_torch(logits, st, positions))


def test_rejection_at_full_vocabulary():
    batch = 8
    gen = torch.Generator(device="cuda").manual_seed(2)
    st = SamplingTensors.from_params(params(batch), device="cuda")
    logits = torch.randn(batch, K + 1, V, device="cuda", generator=gen) * 3
    # drafts from sparse q over the target's own top candidates, so some are accepted
    cand_ids = torch.topk(logits[:, :K], K_SEL, dim=-1).indices  # [B, k, K]
    draft_probs = torch.softmax(torch.randn(batch, K, K_SEL, device="cuda", generator=gen), -1)
    picks = torch.multinomial(draft_probs.view(-1, K_SEL), 1, generator=gen).view(batch, K)
    drafts = torch.gather(cand_ids, 2, picks[..., None])[..., 0]
    anchors = torch.arange(batch, device="cuda") * 37 + 5
    acc_tri, out_tri = verify_triton(logits, st, drafts, cand_ids, draft_probs, anchors)
    acc_ref, out_ref = verify_torch(logits, st, drafts, cand_ids, draft_probs, anchors)
    assert torch.equal(acc_tri, acc_ref) and torch.equal(out_tri, out_ref)
    assert int(acc_ref.sum()) > 0  # the case exercises acceptance, not only first-slot rejections


def test_selector_at_released_draft_shapes():
    batch = 4
    gen = torch.Generator(device="cuda").manual_seed(3)
    st = SamplingTensors.from_params(params(batch), device="cuda")
    logits = torch.randn(batch, BLOCK - 1, V, device="cuda", generator=gen) * 3
    hidden = torch.randn(batch, BLOCK, HIDDEN, device="cuda", generator=gen)
    projection = torch.randn(RANK, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5
    pred = torch.randn(V, RANK, device="cuda", generator=gen) * 0.1
    succ = torch.randn(V, RANK, device="cuda", generator=gen) * 0.1
    anchors = torch.randint(0, V, (batch,), device="cuda", generator=gen)
    positions = torch.arange(batch, device="cuda") * 11 + 3
    args = (logits, hidden, projection, pred, succ, anchors, K, K_SEL, st.temperature, st.greedy, st.seeds, positions)
    tri, ref = select_triton(*args), select_torch(*args)
    assert torch.equal(tri.cand_ids, ref.cand_ids)
    assert torch.equal(tri.tokens, ref.tokens)
    assert rms_rel(tri.draft_probs, ref.draft_probs) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attention_at_released_draft_shapes(dtype):
    batch, heads, kv_heads, dim, window = 4, 32, 8, 128, 2048
    capacity, slots = window + 64, 6
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(batch * BLOCK, heads, dim, device="cuda", generator=gen).to(dtype)
    block_k = torch.randn(batch * BLOCK, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    block_v = torch.randn(batch * BLOCK, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    ring_k = torch.randn(slots, capacity, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    ring_v = torch.randn(slots, capacity, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    ring_slots = torch.tensor([0, 3, 5, 1], device="cuda")
    anchors = torch.tensor([5, 2047, 3000, 10_000], device="cuda")
    out = ring_attention_triton(q, block_k, block_v, ring_k, ring_v, ring_slots, anchors, window)
    ref = ring_attention_torch(q, block_k, block_v, ring_k, ring_v, ring_slots, anchors, window)
    bound = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert rms_rel(out, ref) < bound


@pytest.mark.parametrize("batch", [1, 16])
def test_split_ring_attention_replays_bit_for_bit(batch):
    """The split-window kernels at B = 1 (32 splits) and 16 (2 splits): a CUDA-graph replay equals an eager call."""
    heads, kv_heads, dim, window = 32, 8, 128, 2048
    gen = torch.Generator(device="cuda").manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).bfloat16()  # noqa: E731
    q, block_k, block_v = rand(batch * BLOCK, heads, dim), rand(batch * BLOCK, kv_heads, dim), rand(batch * BLOCK,
                                                                                                 kv_heads, dim)
    ring_k, ring_v = rand(batch + 1, window + 64, kv_heads, dim), rand(batch + 1, window + 64, kv_heads, dim)
    ring_slots = torch.arange(batch, device="cuda")
    anchors = torch.randint(0, 20_000, (batch,), device="cuda", generator=gen)
    anchors[0] = 300  # partly before position 0
    args = (q, block_k, block_v, ring_k, ring_v, ring_slots, anchors, window)
    eager = ring_attention_triton(*args)
    assert rms_rel(eager, ring_attention_torch(*args)) < 2e-2
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ring_attention_triton(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ring_attention_triton(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_draft_block_kernels_at_released_shapes():
    """The draft's conv side (with the residual) and q/k prologue at C = 5120, G = 16, 32/8 heads of 128, B = 16."""
    rows, heads, kv_heads, dim = 16 * BLOCK, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(6)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).bfloat16()  # noqa: E731
    x, residual = rand(16, BLOCK, HIDDEN), rand(16, BLOCK, HIDDEN)
    base, delta = rand(2, HIDDEN) * 0.5, rand(16, BLOCK, 2, 2, HIDDEN // 16)[:, :, 1] * 0.2
    conv = grouped_dynamic_conv_triton(x, base, delta, 16, residual)
    assert rms_rel(conv, grouped_dynamic_conv_torch(x.float(), base.float(), delta.float(), 16, residual.float())) < 2e-2
    q, kv = rand(rows, heads, dim), rand(rows, 2 * kv_heads, dim)
    scales = [1.0 + 0.3 * torch.randn(dim, device="cuda", generator=gen) for _ in range(2)]
    cos, sin = rope_cos_sin(torch.randint(0, 100_000, (rows,), device="cuda", generator=gen), dim, 1e7)
    got = draft_qk_norm_rope_triton(q, kv[:, :kv_heads], *scales, cos, sin, 1e-6)
    ref = draft_qk_norm_rope_torch(q.float(), kv[:, :kv_heads].float(), *scales, cos, sin, 1e-6)
    assert rms_rel(got[0], ref[0]) < 2e-2 and rms_rel(got[1], ref[1]) < 2e-2


@pytest.mark.parametrize("value_heads", [32, 48], ids=["35b-a3b", "27b"])
def test_gdn_verify_commit_replays_bit_identically_at_released_shapes(value_heads):
    """Rollback by replay at Hv = 32 or 48 / Hk = 16 heads of 128, R = 8 rows, bf16 v, the launchers' default
    tiles (what the engine runs): the verify recurrence stores its rows' inputs and writes no state; the commit
    then leaves in every slot bit for bit the final state of a decode-style run of the kept rows through the
    recurrence kernel (fast/kernels/gdn/gdn_commit.py: the same tiles, warps and row update); NUMERIC fp32 against
    the torch commit; the conv state EXACT against it."""
    layers, seqs, rows, hk, dk, cd, taps = 2, 5, 8, 16, 128, 64, 3
    gen = torch.Generator(device="cuda").manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    recurrent = rand(layers, seqs + 2, value_heads, dk, dk) * 0.1  # [L, S, Hv, Dk, Dv]
    conv = rand(layers, seqs + 2, cd, taps).bfloat16()
    verify_conv = rand(layers, seqs, rows, cd).bfloat16()
    scratch = VerifyRowInputs(torch.full((layers, seqs, rows, hk, dk), float("nan"), device="cuda"),
                              torch.full((layers, seqs, rows, value_heads, dk), float("nan"), device="cuda",
                                         dtype=torch.bfloat16),
                              torch.full((layers, seqs, rows, value_heads), float("nan"), device="cuda"),
                              torch.full((layers, seqs, rows, value_heads), float("nan"), device="cuda"))
    slots = torch.tensor([3, 0, 6, 2, 5], device="cuda")
    zero_state = torch.tensor([False, False, True, False, False], device="cuda")
    readable = torch.where(zero_state, -1, slots)
    kept = torch.tensor([1, 8, 3, 5, 2], device="cuda")
    cu = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * rows
    inputs = []
    for layer in range(layers):
        q = torch.nn.functional.normalize(rand(seqs * rows, hk, dk), dim=-1) * dk ** -0.5
        k = torch.nn.functional.normalize(rand(seqs * rows, hk, dk), dim=-1)
        v = rand(seqs * rows, value_heads, dk).bfloat16()
        g = -torch.nn.functional.softplus(rand(seqs * rows, value_heads))
        inputs.append((q, k, v, g, torch.sigmoid(rand(seqs * rows, value_heads))))
    pre_step = recurrent.clone()
    for layer, rows_in in enumerate(inputs):
        gated_delta_rule_verify_triton(*rows_in, recurrent[layer], cu, rows, state_index=readable,
                                       verify_rows=VerifyRowInputs(*(t[layer] for t in scratch)),
                                       output_final_state=False)
    assert torch.equal(recurrent, pre_step), "the verify wrote a state"
    twin = (conv.clone(), recurrent.clone())
    commit_verify_triton(conv, recurrent, verify_conv, scratch, slots, zero_state, kept)
    commit_verify_torch(*twin, verify_conv, scratch, slots, zero_state, kept)
    assert torch.equal(conv, twin[0])
    assert rms_rel(recurrent[:, slots], twin[1][:, slots]) < 1e-5
    kept_rows = torch.cat([torch.arange(int(n), device="cuda") + b * rows for b, n in enumerate(kept.tolist())])
    kept_cu = torch.cat([kept.new_zeros(1), kept.cumsum(0)]).to(torch.int32)
    for layer, rows_in in enumerate(inputs):
        _, run = gated_delta_rule_verify_triton(*(t[kept_rows] for t in rows_in), pre_step[layer].clone(), kept_cu,
                                                int(kept.max()), state_index=readable)
        assert torch.equal(recurrent[layer, slots], run), f"layer {layer}: the replay is not the run's state"
