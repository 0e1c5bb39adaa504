"""FastDraft vs ReferenceDraft: context rows, context K/V, each layer, hidden and logits of batched blocks.

Several requests at different anchors share one ``forward_blocks`` call: an anchor with fewer
than W-1 committed rows, exactly W-1, a wrapped ring, and (window 2048) a prompt longer than the
ring written in one call, so the in-call "last row wins" rule decides the slots.

The block side's CUDA composition (fused norms, the conv kernel with the residual add, the q/k
prologue kernel, the split-window ring attention as planned for an H200's 132 SMs, the SwiGLU activation
kernel) is run here too,
on the CPU under Triton's interpreter, against the same reference at the same fp32 bound.
"""

from __future__ import annotations

import os

import pytest
import torch

import dflash2.fast.kernels.attention.paged_attention as paged_attention
from dflash2.fast.kernels.common.dispatch import forced_gpu
from dflash2.fast.kernels.common.triton_compat import HAS_TRITON
from dflash2.fast.model.draft import batch_invariant_linear
from dflash2.fast.speculative.dflash import FastDFlashProposer
from dflash2.reference.speculative.ring import Ring
from draft_harness import DEVICE, features_of, new_log, random_taps, reference_block_layers


def test_context_rows_and_kv_match_the_reference(small_window, tiny_target):
    log = new_log("context")
    _, target_cfg, _ = tiny_target
    ref, fast = small_window.reference, small_window.fast
    gen = torch.Generator().manual_seed(0)
    taps = random_taps(target_cfg.num_hidden_layers, 37, target_cfg.hidden_size, gen)
    rows = fast.context_rows(features_of(taps, ref.cfg.target_layer_ids).to(DEVICE))
    ref_rows = ref.context_rows(taps)
    log.add("c_p", rows, ref_rows)
    positions = torch.randint(0, 5000, (37,), generator=gen)
    k, v = fast.context_kv(ref_rows.to(DEVICE), positions.to(DEVICE))
    ref_k, ref_v = ref.context_kv(ref_rows, positions)
    log.add("context k", k, ref_k)
    log.add("context v", v, ref_v)


def test_context_kv_is_batch_invariant(released_window):
    """A row's K/V has the same bits alone, in a verify-sized call, or inside a 2047-row restore."""
    fast = released_window.fast
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(2047, fast.cfg.hidden_size, generator=gen).to(DEVICE)
    positions = torch.arange(5000, 5000 + 2047, device=DEVICE)
    k_all, v_all = fast.context_kv(rows, positions)
    for start, count in ((0, 1), (5, 8), (100, 63), (700, 65), (1900, 147)):
        k, v = fast.context_kv(rows[start:start + count], positions[start:start + count])
        assert torch.equal(k, k_all[:, start:start + count]) and torch.equal(v, v_all[:, start:start + count])
    weight = torch.randn(96, 1000, generator=gen).to(DEVICE)
    x = torch.randn(300, 1000, generator=gen).to(DEVICE)
    full = batch_invariant_linear(x, weight)
    for i, n in ((0, 1), (3, 9), (70, 200)):
        assert torch.equal(batch_invariant_linear(x[i:i + n], weight), full[i:i + n])


def test_fused_block_weights_hold_the_checkpoint_rows(small_window):
    """EXACT: each layer's block-side [q; k; v] matrix is the checkpoint's rows, its k|v rows those of the
    context side's stacked matrix; the per-name entries are views into the fused matrices."""
    ref, fast = small_window.reference, small_window.fast
    cfg = fast.cfg
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, 2 * cfg.num_key_value_heads * cfg.head_dim
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        fused = fast.block_qkv_weights[layer]
        expected = torch.cat([ref.w[f"{p}self_attn.{name}_proj.weight"] for name in "qkv"])
        assert fused.is_contiguous() and torch.equal(fused.cpu(), expected)
        assert torch.equal(fused[q_rows:], fast.context_kv_weight[layer * kv_rows:(layer + 1) * kv_rows])
        assert fast.w[f"{p}self_attn.q_proj.weight"].data_ptr() == fused.data_ptr()
        assert fast.w[f"{p}self_attn.k_proj.weight"].data_ptr() == fast.context_kv_weight[layer * kv_rows].data_ptr()
        assert fast.w[f"{p}mlp.gate_proj.weight"].data_ptr() == fast.gate_up[layer].data_ptr()
        for conv in ("attention_conv", "mlp_conv"):
            assert fast.w[f"{p}{conv}.kernel_projection.weight"].is_contiguous()


def _compare_blocks(pair, tiny_target, prompt_lens: list[int], slots: list[int], num_slots: int, name: str):
    """Prefill every request in one observe call, then draft all blocks at once and compare."""
    log = new_log(name)
    _, target_cfg, _ = tiny_target
    ref, fast = pair.reference, pair.fast
    cfg = ref.cfg
    gen = torch.Generator().manual_seed(sum(prompt_lens))
    proposer = FastDFlashProposer(fast, num_slots, poison=True)
    row_shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim)
    rings, features, row_slots, positions = [], [], [], []
    for n, slot in zip(prompt_lens, slots):
        taps = random_taps(target_cfg.num_hidden_layers, n, target_cfg.hidden_size, gen)
        ring = Ring(cfg.sliding_window, row_shape)
        k, v = ref.context_kv(ref.context_rows(taps), torch.arange(n))
        ring.write(torch.arange(n), torch.stack([k, v], dim=2).transpose(0, 1))
        rings.append(ring)
        features.append(features_of(taps, cfg.target_layer_ids))
        row_slots.append(torch.full((n,), slot))
        positions.append(torch.arange(n))
    # the requests' rows interleaved in chunks of 17, each request's rows in position order
    chunks = [(b, i) for i in range(0, max(prompt_lens), 17) for b in range(len(slots)) if i < prompt_lens[b]]
    pick = lambda ts: torch.cat([ts[b][i:i + 17] for b, i in chunks]).to(DEVICE)  # noqa: E731
    proposer.observe_rows(pick(row_slots), pick(positions), pick(features))

    anchors = torch.tensor(prompt_lens, device=DEVICE)
    slot_t = torch.tensor(slots, device=DEVICE)
    anchor_tokens = torch.randint(0, cfg.vocab_size, (len(slots),), generator=gen).to(DEVICE)
    proposer.ring.check_readable(slot_t, anchors)
    layers: list[torch.Tensor] = []
    blocks = fast.forward_blocks(anchor_tokens, anchors, proposer.ring, slot_t, layer_outputs=layers)
    assert blocks.logits.dtype == fast.dtype  # the LM head's output as written, no fp32 copy
    for b, (n, ring) in enumerate(zip(prompt_lens, rings)):
        ctx_positions, rows = ring.read(n)
        ctx_k, ctx_v = rows[:, :, 0].transpose(0, 1), rows[:, :, 1].transpose(0, 1)
        for layer in range(cfg.num_hidden_layers):
            gathered_k, gathered_v, valid = proposer.ring.gather(layer, slot_t, anchors)
            read = anchors[b] - cfg.sliding_window + 1 + torch.nonzero(valid[b]).squeeze(1)
            assert torch.equal(read.cpu(), ctx_positions)  # EXACT: the positions each block reads
            log.add("ring k", gathered_k[b][valid[b]], ctx_k[layer])
            log.add("ring v", gathered_v[b][valid[b]], ctx_v[layer])
        expected = ref.forward_block(int(anchor_tokens[b]), n, ctx_positions, ctx_k, ctx_v)
        for layer, out in enumerate(reference_block_layers(ref, int(anchor_tokens[b]), n, ctx_positions, ctx_k, ctx_v)):
            log.add(f"layer {layer} output", layers[layer][b], out)
        log.add("hidden", blocks.hidden[b], expected.hidden)
        log.add("logits", blocks.logits[b], expected.logits)


def test_blocks_match_the_reference_small_window(small_window, tiny_target):
    """W = 24, ring 88: anchors at 3 (< W-1 rows), 23 (exactly W-1), 40, 150 (wrapped), 89."""
    _compare_blocks(small_window, tiny_target, [3, 23, 40, 150, 89], [6, 0, 3, 1, 4], 7, "blocks W=24")


def test_blocks_match_the_reference_released_window(released_window, tiny_target):
    """W = 2048, ring 2112: a 2200-row prompt written in one call wraps the ring; 2047 and 9 rows."""
    _compare_blocks(released_window, tiny_target, [2200, 2047, 9], [2, 0, 1], 3, "blocks W=2048")


@pytest.fixture
def cuda_kernels(monkeypatch):
    """Every block-side dispatch sent to its Triton kernel (the interpreter without a GPU), planned for 132 SMs."""
    if not HAS_TRITON or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs Triton on CUDA or its interpreter")
    monkeypatch.setattr(paged_attention, "_sm_count", lambda device: 132)
    with forced_gpu():
        yield


def test_blocks_match_the_reference_with_the_cuda_kernels(small_window, released_window, tiny_target, cuda_kernels):
    """The two tests above, every block-side op by its kernel (W = 2048: 32 splits of 64 keys, then the merge)."""
    _compare_blocks(small_window, tiny_target, [3, 23, 40, 150, 89], [6, 0, 3, 1, 4], 7, "blocks W=24, kernels")
    _compare_blocks(released_window, tiny_target, [2200, 2047, 9], [2, 0, 1], 3, "blocks W=2048, kernels")


def test_rows_outside_a_blocks_window_are_never_read(small_window):
    """NaN in every ring row a block must not read (older than s-W+1, or at s and later) leaves it finite and equal."""
    fast, cfg = small_window.fast, small_window.fast.cfg
    gen = torch.Generator().manual_seed(3)
    proposer = FastDFlashProposer(fast, 2, poison=True)
    n = 60
    proposer.observe_rows(torch.zeros(n, dtype=torch.long, device=DEVICE), torch.arange(n, device=DEVICE),
                     torch.randn(n, cfg.num_taps * cfg.hidden_size, generator=gen).to(DEVICE))
    s, token, slot = (torch.tensor([x], device=DEVICE) for x in (40, 7, 0))
    clean = fast.forward_blocks(token, s, proposer.ring, slot)
    index = proposer.ring.ring_index
    outside = [p for p in range(n) if not 40 - cfg.sliding_window + 1 <= p < 40]
    for t in (proposer.ring.k, proposer.ring.v):
        t[:, 0, index(torch.tensor(outside, device=DEVICE))] = float("nan")
    poisoned = fast.forward_blocks(token, s, proposer.ring, slot)
    assert torch.equal(poisoned.logits, clean.logits) and torch.equal(poisoned.hidden, clean.hidden)
