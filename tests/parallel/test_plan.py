"""The tensor-parallel sharding plan (fast/parallel/plan.py) on the tiny presets, without processes.

Every canonical tensor has a rule; each rank's part has the shape the rank's config view expects (so the
fast modules and the pools built from ``rank_config`` fit it); the ranks' parts reassemble the full tensor
(every element held exactly once, or everywhere for replicated tensors); fused tensors split per segment.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.parallel import TPGroup, rank_config, shard_spec, shard_tensor
from dflash2.reference.formats.weights import expected_target_shapes
from dflash2.reference.tiny.target import tiny_target_config

PRESETS = ("tiny-dense", "tiny-moe")


@pytest.mark.parametrize("preset", PRESETS)
def test_parts_fit_rank_config_and_reassemble(preset):
    cfg = tiny_target_config(preset)
    tp = 2
    local_shapes = expected_target_shapes(rank_config(cfg, tp))
    for name, shape in expected_target_shapes(cfg).items():
        spec = shard_spec(name, cfg)
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        parts = [shard_tensor(full, spec, r, tp) for r in range(tp)]
        for part in parts:
            assert tuple(part.shape) == tuple(local_shapes[name]), name
        if spec.replicated:
            assert all(torch.equal(p, full) for p in parts), name
        else:  # every element exactly once
            seen = torch.cat([p.flatten() for p in parts]).sort().values
            assert torch.equal(seen, full.flatten()), name


def test_gdn_qkv_rows_split_per_segment():
    cfg = tiny_target_config("tiny-moe")  # Hk 2, Dk 8, Hv 6, Dv 8: q 16, k 16, v 48 rows
    rows = torch.arange(cfg.gdn_conv_dim)
    part = shard_tensor(rows, shard_spec("layers.0.linear_attn.in_proj_qkv.weight", cfg), 1, 2)
    key, value = cfg.gdn_key_dim, cfg.gdn_value_dim
    expected = torch.cat([rows[key // 2:key], rows[key + key // 2:2 * key], rows[2 * key + value // 2:]])
    assert torch.equal(part, expected)


def test_unknown_tensor_and_group():
    with pytest.raises(KeyError, match="no tensor-parallel sharding rule"):
        shard_spec("layers.0.mlp.mystery.weight", tiny_target_config("tiny-dense"))
    with pytest.raises(ValueError):
        TPGroup(rank=2, size=2)
    single = TPGroup.single()
    x = torch.randn(3, 4)
    assert single.all_reduce(x) is x and single.all_gather(x) is x
