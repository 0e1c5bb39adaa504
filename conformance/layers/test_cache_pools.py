"""The cache pools on their own: sizing the engine relies on, fresh contents, refusals."""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.model.pools import CachePools
from dflash2.fast.model.target import FastTarget
from dflash2.reference.tiny.target import tiny_target_config, tiny_target_weights
from fast_model_harness import Seq, make_batch


def visible_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dense-text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_counts_match_what_is_allocated(preset, dtype):
    cfg = tiny_target_config(preset)
    pools = CachePools(cfg, num_pages=7, page_size=5, num_slots=3, max_verify_rows=4, dtype=dtype, device="cpu",
                       max_verify_seqs=2)
    kv = [t for layer in [*pools.attention.values(), *([pools.mtp] if pools.mtp else [])]
          for t in (layer.keys, layer.values)]
    assert visible_bytes(kv) == pools.bytes_per_token() * 7 * 5
    assert visible_bytes(t for s in pools.gdn.values() for t in (s.conv, s.recurrent)) == pools.bytes_per_slot() * 3
    scratch = (t for s in pools.gdn.values() for t in (s.verify_conv_inputs, *s.verify_rows))
    assert visible_bytes(scratch) == pools.verify_scratch_bytes()
    assert pools.has_mtp == bool(cfg.mtp_num_hidden_layers)
    assert all(s.recurrent.dtype == torch.float32 and s.conv.dtype == dtype for s in pools.gdn.values())


def test_fresh_pools_are_zero_or_poisoned():
    cfg = tiny_target_config("tiny-dense")
    zeros = CachePools(cfg, 2, 4, 2, 3, torch.float32, "cpu")
    poisoned = CachePools(cfg, 2, 4, 2, 3, torch.float32, "cpu", poison=True)
    layer = cfg.linear_attention_layers[0]
    assert (zeros.gdn[layer].recurrent == 0).all() and zeros.mtp.keys.eq(0).all()
    assert poisoned.gdn[layer].recurrent.isnan().all() and poisoned.mtp.keys.isnan().all()


def test_refusals():
    cfg = tiny_target_config("tiny-dense")
    with pytest.raises(ValueError, match="num_pages"):
        CachePools(cfg, 0, 4, 2, 3, torch.float32, "cpu")
    with pytest.raises(ValueError, match="no MTP head"):
        CachePools(tiny_target_config("tiny-dense-text"), 2, 4, 2, 3, torch.float32, "cpu", mtp=True)
    assert CachePools(cfg, 2, 4, 2, 3, torch.float32, "cpu", mtp=False).mtp is None


def test_a_verify_batch_larger_than_the_scratch_is_refused():
    cfg = tiny_target_config("tiny-dense")
    target = FastTarget(cfg, tiny_target_weights(cfg, seed=0), torch.float32, "cpu")
    pools = CachePools(cfg, 4, 4, 2, max_verify_rows=3, dtype=torch.float32, device="cpu")
    batch = make_batch([(Seq(0, [0, 1]), torch.arange(4))], page_size=4, max_pages=2, device=torch.device("cpu"),
                       is_verify=True)
    with pytest.raises(ValueError, match="exceeds the scratch"):
        target.forward(batch, pools)
