"""The MTP head: shapes, its own KV cache (whole vs step vs rollback), and chaining.

No oracle exists for the MTP head (transformers drops the mtp.* tensors), so these tests hold it
to itself: the forms that must agree do, and the cache really carries context.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.reference.formats.errors import ConfigError
from dflash2.reference.model.mtp import ReferenceMTP, greedy_chain
from hf_tiny import rms_rel_err, target_config

TOL = 1e-5


@pytest.fixture
def mtp_inputs(tiny_target, prompt):
    """The MTP's prompt pairs: target hidden at p with the token at p+1, for p = 0 .. T-2."""
    hidden = tiny_target.target.forward(prompt).hidden  # [T, C] after the final norm
    return ReferenceMTP(tiny_target.cfg, tiny_target.weights), hidden[:-1], prompt[1:]


def test_shapes(tiny_target, mtp_inputs):
    mtp, hidden, tokens = mtp_inputs
    cache = mtp.new_cache()
    logits, out = mtp.forward(hidden, tokens, cache)
    cfg = tiny_target.cfg
    assert logits.shape == (tokens.shape[0], cfg.vocab_size) and out.shape == (tokens.shape[0], cfg.hidden_size)
    assert cache.length == tokens.shape[0]
    assert torch.isfinite(logits).all()


def test_whole_equals_steps(mtp_inputs):
    mtp, hidden, tokens = mtp_inputs
    whole = mtp.forward(hidden, tokens)
    cache = mtp.new_cache()
    steps = [mtp.forward(hidden[i:i + 1], tokens[i:i + 1], cache) for i in range(tokens.shape[0])]
    assert rms_rel_err(torch.cat([s.logits for s in steps]), whole.logits) < TOL
    assert rms_rel_err(torch.cat([s.hidden for s in steps]), whole.hidden) < TOL


def test_cache_carries_context(mtp_inputs):
    """At the same position, the last pair's output depends on which pairs the cache holds."""
    mtp, hidden, tokens = mtp_inputs
    with_context = mtp.forward(hidden, tokens).logits[-1]
    other_cache = mtp.new_cache()
    mtp.forward(hidden[:-1].flip(0), tokens[:-1].flip(0), other_cache)  # same length, other pairs
    other_context = mtp.forward(hidden[-1:], tokens[-1:], other_cache).logits[-1]
    assert rms_rel_err(other_context, with_context) > 1e-3


def test_chaining_is_appending_a_pair_and_rollback_restores(mtp_inputs):
    mtp, hidden, tokens = mtp_inputs
    cache = mtp.new_cache()
    mtp.forward(hidden[:-1], tokens[:-1], cache)
    prefix = cache.clone()
    drafts = greedy_chain(mtp, hidden[-1], int(tokens[-1]), cache, k=3)
    assert len(drafts) == 3 and cache.length == prefix.length + 3

    # By hand: step 1 reads the target pair; steps 2, 3 read the MTP's own hidden output and draft.
    manual = prefix.clone()
    logits, h = mtp.forward(hidden[-1:], tokens[-1:], manual)
    expected = [int(logits[-1].argmax())]
    for _ in range(2):
        logits, h = mtp.forward(h, torch.tensor([expected[-1]]), manual)
        expected.append(int(logits[-1].argmax()))
    assert drafts == expected
    torch.testing.assert_close(manual.kv.keys, cache.kv.keys)

    # Rolling back to the prefix and feeding the target pair again equals a fresh whole run.
    cache.truncate(prefix.length)
    again = mtp.forward(hidden[-1:], tokens[-1:], cache).logits
    assert rms_rel_err(again, mtp.forward(hidden, tokens).logits[-1:]) < TOL


def test_target_without_mtp_is_refused(dense_target):
    cfg = target_config(dense_target.hf_model, mtp=False)
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers"):
        ReferenceMTP(cfg, dense_target.weights)
