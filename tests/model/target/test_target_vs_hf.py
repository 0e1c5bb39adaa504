"""The reference target against transformers' own Qwen3.5 implementation (the oracle), in fp32."""

from __future__ import annotations

import pytest
import torch

import dflash2.reference.model.attention as attention_module
import dflash2.reference.model.gdn as gdn_module
import dflash2.reference.model.layer as layer_module
import dflash2.reference.model.moe as moe_module
from dflash2.reference.model.delta_rule import gated_delta_rule_recurrent
from dflash2.reference.model.gdn import causal_conv1d
from dflash2.reference.model.norm import rms_norm
from dflash2.reference.model.rope import apply_rope
from hf_tiny import rms_rel_err

TOL = 1e-5  # RMS-relative, fp32 against fp32


def _capture_layer_outputs(hf_model):
    """Hooks recording each HF decoder layer's output (the residual stream after the layer)."""
    captured: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out))
             for layer in hf_model.model.layers]
    return captured, hooks


def test_whole_sequence_matches_transformers(tiny_target, prompt):
    hf_model, target = tiny_target.hf_model, tiny_target.target
    captured, hooks = _capture_layer_outputs(hf_model)
    try:
        with torch.no_grad():
            expected = hf_model(prompt[None], output_hidden_states=True, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    ours = target.forward(prompt)
    assert rms_rel_err(ours.logits, expected.logits[0]) < TOL
    assert rms_rel_err(ours.hidden, expected.hidden_states[-1][0]) < TOL  # HF's last entry: after the final norm
    assert len(ours.taps) == tiny_target.cfg.num_hidden_layers == len(captured)
    for i, (tap, hf_out) in enumerate(zip(ours.taps, captured, strict=True)):
        assert rms_rel_err(tap, hf_out[0]) < TOL, f"layer {i}"
    for layer in range(tiny_target.cfg.num_hidden_layers - 1):
        assert rms_rel_err(ours.taps[layer], expected.hidden_states[layer + 1][0]) < TOL, f"layer {layer}"


def test_step_by_step_matches_transformers_with_cache(tiny_target, prompt):
    hf_model, target = tiny_target.hf_model, tiny_target.target
    cache, hf_cache = target.new_cache(), None
    for t in range(prompt.shape[0]):
        with torch.no_grad():
            expected = hf_model(prompt[None, t:t + 1], cache=hf_cache, use_cache=True, output_hidden_states=True)
        hf_cache = expected.cache
        ours = target.forward(prompt[t:t + 1], cache)
        assert cache.length == t + 1
        assert rms_rel_err(ours.logits, expected.logits[0]) < TOL, f"token {t}"
        for layer in range(tiny_target.cfg.num_hidden_layers - 1):
            assert rms_rel_err(ours.taps[layer], expected.hidden_states[layer + 1][0]) < TOL, f"token {t} layer {layer}"


def test_greedy_generation_matches_transformers_generate(tiny_target, prompt):
    hf_model, target = tiny_target.hf_model, tiny_target.target
    new_tokens = 12
    with torch.no_grad():
        expected = hf_model.generate(prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
    cache = target.new_cache()
    logits = target.forward(prompt, cache).logits
    ours = []
    for _ in range(new_tokens):  # argmax of the last row, fed back alone
        ours.append(int(torch.argmax(logits[-1])))
        logits = target.forward(torch.tensor(ours[-1:]), cache).logits
    assert ours == expected[0, prompt.shape[0]:].tolist()


# Each planted bug: (module, name looked up at call time, a wrong replacement).
def _norm_weight_as_w(x, weight, eps):
    return rms_norm(x, weight - 1.0, eps)  # (1 + (w - 1)) = w: the Llama convention


def _rope_whole_head(x, positions, rotary_dim, theta):
    return apply_rope(x, positions, x.shape[-1], theta)


def _conv_kernel_reversed(x, state, weight):
    return causal_conv1d(x, state, weight.flip(-1))


def _decay_halved(q, k, v, g, beta, state):
    return gated_delta_rule_recurrent(q, k, v, g / 2, beta, state)


def _router_not_renormalised(x, w_router, top_k):
    top_probs, expert_ids = torch.topk(torch.softmax(x @ w_router.T, dim=-1), top_k, dim=-1)
    return expert_ids, top_probs


PLANTED_BUGS = {
    "norm weight applied as w": (layer_module, "rms_norm", _norm_weight_as_w),
    "rope over the whole head": (attention_module, "apply_rope", _rope_whole_head),
    "conv kernel reversed": (gdn_module, "causal_conv1d", _conv_kernel_reversed),
    "decay halved": (gdn_module, "gated_delta_rule_recurrent", _decay_halved),
    "router weights not renormalised": (moe_module, "route", _router_not_renormalised),
}


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_a_planted_bug_fails_the_oracle(moe_target, prompt, monkeypatch, bug):
    """Self-test: each planted bug moves the logits far outside the tolerance."""
    module, name, replacement = PLANTED_BUGS[bug]
    with torch.no_grad():
        expected = moe_target.hf_model(prompt[None], use_cache=False).logits[0]
    monkeypatch.setattr(module, name, replacement)
    assert rms_rel_err(moe_target.target.forward(prompt).logits, expected) > 100 * TOL
