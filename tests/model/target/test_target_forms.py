"""The reference target's whole-sequence, step and mixed forms agree; its cache behaves."""

from __future__ import annotations

import pytest
import torch

from dflash2.reference.formats.errors import CheckpointError, RequestError
from dflash2.reference.model.target import ReferenceTarget
from hf_tiny import rms_rel_err

TOL = 1e-5


def _run_in_pieces(target, prompt, sizes):
    cache = target.new_cache()
    outputs = []
    start = 0
    for size in sizes:
        outputs.append(target.forward(prompt[start:start + size], cache))
        start += size
    assert start == prompt.shape[0] == cache.length
    logits = torch.cat([o.logits for o in outputs])
    taps = [torch.cat([o.taps[layer] for o in outputs]) for layer in range(len(outputs[0].taps))]
    return logits, taps


@pytest.mark.parametrize("sizes", [[1] * 13, [5, 3, 1, 1, 3], [12, 1]])
def test_whole_equals_pieces(tiny_target, prompt, sizes):
    target = tiny_target.target
    whole = target.forward(prompt)
    logits, taps = _run_in_pieces(target, prompt, sizes)
    assert rms_rel_err(logits, whole.logits) < TOL
    for layer, tap in enumerate(taps):
        assert rms_rel_err(tap, whole.taps[layer]) < TOL, f"layer {layer}"


def test_clone_is_independent(dense_target, prompt):
    target = dense_target.target
    cache = target.new_cache()
    target.forward(prompt[:6], cache)
    snapshot = cache.clone()
    first = target.forward(prompt[6:8], cache).logits
    assert snapshot.length == 6 and cache.length == 8
    again = target.forward(prompt[6:8], snapshot).logits  # from the snapshot: the same two tokens again
    torch.testing.assert_close(again, first)


def test_missing_or_misshaped_tensor_is_named(dense_target):
    cfg, weights = dense_target.cfg, dict(dense_target.weights)
    name = "layers.2.self_attn.q_norm.weight"
    with pytest.raises(CheckpointError, match=name):
        ReferenceTarget(cfg, {k: v for k, v in weights.items() if k != name})
    with pytest.raises(CheckpointError, match=r"layers\.0\.linear_attn\.A_log.*\[5\].*\[4\]"):
        ReferenceTarget(cfg, weights | {"layers.0.linear_attn.A_log": torch.zeros(5)})


def test_weights_are_converted_to_fp32(dense_target, prompt):
    half = {k: v.to(torch.bfloat16) for k, v in dense_target.weights.items()}
    target = ReferenceTarget(dense_target.cfg, half)
    assert target.forward(prompt[:3]).logits.dtype == torch.float32


@pytest.mark.parametrize("bad", [torch.tensor([], dtype=torch.long), torch.tensor([[1, 2]]), torch.tensor([97]),
                                 torch.tensor([-1]), torch.tensor([1.0])])
def test_bad_token_ids_are_refused(dense_target, bad):
    with pytest.raises(RequestError):
        dense_target.target.forward(bad)


def test_attention_refuses_positions_that_do_not_continue_the_cache(dense_target):
    attention_layer = dense_target.target.layers[2]  # a full-attention layer
    cache = attention_layer.new_state()
    x = torch.randn(2, dense_target.cfg.hidden_size)
    attention_layer.forward(x, torch.arange(0, 2), cache)
    with pytest.raises(ValueError, match="positions start at 3"):
        attention_layer.forward(x, torch.arange(3, 5), cache)
