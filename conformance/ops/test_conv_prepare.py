"""fast/kernels/conv_prepare.py (the fused Triton kernel and its torch twin, the unfused composition)
vs reference/model/draft.qwen3_rms_norm followed by reference/model/conv.conv_prepare, block by block
in fp32: u' and the whole delta (both sides), NUMERIC (fp32 1e-5, bf16 2e-2). The Triton launcher is
held to the torch twin too.

Shapes (B, S, C, G, K): the released channel layout C = 2048, G = 16, K = 2, S = 8 with B = 1 (one
row tile, 8 of its 16 rows live) and B = 3 (24 rows: the second tile half empty), 32 group tiles;
a tiny one (C = 64, one group tile); a mask shape (S = 5, C = 40, G = 4, K = 3: 10 groups in tiles of
3, the last one group; the dot's N of 18 padded to 32; C walked in chunks of 16, the last one 8
wide; 20 rows in tiles of 15); more taps than rows (K = 4, S = 3). x is a view into a NaN-poisoned
buffer (row stride wider than C): a read outside the rows makes the result non-finite.

In bf16 the interpreter's fast side sits further from the reference than the twin does: Triton
3.6's interpreter rounds to bf16 toward zero (u, delta and u' each lose half an ulp the same way);
on CUDA the roundings are to nearest.

The CPU dispatcher is EXACT against the unfused ops the draft ran before (add_rms_norm, the GEMM,
grouped_dynamic_conv). Planted bugs: one conv over all B*S rows (taps crossing block starts), and
the norm weight used zero-centred (1 + w), must fail.
"""

from __future__ import annotations

import functools

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.conv_prepare import norm_conv_prepare, norm_conv_prepare_torch, norm_conv_prepare_triton
from dflash2.fast.kernels.dynamic_conv import grouped_dynamic_conv
from dflash2.fast.model.norm import add_rms_norm
from dflash2.reference.model.conv import conv_prepare
from dflash2.reference.model.draft import qwen3_rms_norm

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
# B, S, C, G, K, the Triton launcher's tiling
SHAPES = [
    ((1, 8, 2048, 16, 2), {}),
    ((3, 8, 2048, 16, 2), {}),
    ((2, 8, 64, 16, 2), {}),
    ((4, 5, 40, 4, 3), {"groups_per_program": 3, "max_block_k": 16}),
    ((2, 3, 24, 4, 4), {}),
]


def shape_id(case) -> str:
    (b, s, c, g, k), tiling = case
    return f"B{b}-S{s}-C{c}-G{g}-K{k}" + ("-tiled" if tiling else "")


def make_inputs(batch: int, rows: int, channels: int, group: int, taps: int, device: str, dtype: torch.dtype,
                seed: int):
    """x [B, S, C] (a view with row stride C + 7 into a NaN buffer), the fp32 norm weight, W_kp, base."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((batch * rows, channels + 7), float("nan"))
    buf[:, 3:3 + channels] = torch.randn(batch * rows, channels, generator=gen) * 3
    x = buf.to(device, dtype)[:, 3:3 + channels].view(batch, rows, channels)
    norm_weight = (1.0 + 0.3 * torch.randn(channels, generator=gen)).to(device)  # as stored, near 1
    proj = (torch.randn(2 * taps * channels // group, channels, generator=gen) * channels ** -0.5).to(device, dtype)
    base = (torch.randn(2, taps, channels, generator=gen) * 0.5).to(device, dtype)
    return x, norm_weight, proj, base


def reference(x, norm_weight, proj, base, group: int):
    """qwen3_rms_norm then conv_prepare per block, fp32 on the CPU: ``(u' [B, S, C], delta [B, S, 2, K, C/G])``."""
    x, norm_weight, proj, base = (t.float().cpu() for t in (x, norm_weight, proj, base))
    outs = [conv_prepare(qwen3_rms_norm(x[b], norm_weight, EPS), base, proj, group) for b in range(x.shape[0])]
    return torch.stack([u for u, _ in outs]), torch.stack([d for _, d in outs])


@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
def test_norm_conv_prepare_matches_reference(impl_device, report, case):
    impl, device = impl_device
    shape, tiling = case
    batch, rows, channels, group, taps = shape
    fn = pick(impl, norm_conv_prepare_torch, functools.partial(norm_conv_prepare_triton, **tiling))
    for dtype in DTYPES:
        x, norm_weight, proj, base = make_inputs(*shape, device, dtype, seed=sum(shape))
        u_ref, delta_ref = reference(x, norm_weight, proj, base, group)
        u, delta = fn(x, norm_weight, EPS, proj, base, group)
        assert u.dtype == delta.dtype == dtype
        assert u.shape == x.shape and delta.shape == (batch, rows, 2, taps, channels // group)
        name = str(dtype)[6:]
        report.numeric(f"u'/{name}", u, u_ref, NUMERIC_BOUND[dtype])
        report.numeric(f"delta/{name}", delta, delta_ref, NUMERIC_BOUND[dtype])
        if impl == "triton":
            u_twin, delta_twin = norm_conv_prepare_torch(x, norm_weight, EPS, proj, base, group)
            report.numeric(f"twin u'/{name}", u, u_twin, NUMERIC_BOUND[dtype])
            report.numeric(f"twin delta/{name}", delta, delta_twin, NUMERIC_BOUND[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_cpu_dispatch_is_the_unfused_composition(dtype):
    """EXACT: on the CPU ``norm_conv_prepare`` is the norm, the 2-D GEMM and the conv the draft ran before."""
    x, norm_weight, proj, base = make_inputs(3, 8, 64, 16, 2, "cpu", dtype, seed=4)
    u, delta = norm_conv_prepare(x, norm_weight, EPS, proj, base, 16)
    normed = add_rms_norm(x.reshape(24, 64), None, norm_weight, EPS, dtype)[1].view(3, 8, 64)
    delta_old = (normed.reshape(24, 64) @ proj.T).view(3, 8, 2, 2, 4)
    assert torch.equal(delta, delta_old)
    assert torch.equal(u, grouped_dynamic_conv(normed, base[0], delta_old[:, :, 0], 16))


def test_norm_conv_prepare_refusals():
    x, norm_weight, proj, base = make_inputs(2, 4, 16, 4, 2, "cpu", torch.float32, seed=0)
    for fn in (norm_conv_prepare_torch, norm_conv_prepare_triton):
        with pytest.raises(ValueError, match="group_size"):
            fn(x, norm_weight, EPS, proj, base, 5)
        with pytest.raises(ValueError, match="kernel_projection"):
            fn(x, norm_weight, EPS, proj[:-1], base, 4)
        with pytest.raises(ValueError, match="kernel_projection"):
            fn(x, norm_weight, EPS, proj.double(), base, 4)
        with pytest.raises(ValueError, match="base"):
            fn(x, norm_weight, EPS, proj, base[:1], 4)
        with pytest.raises(ValueError, match="norm_weight"):
            fn(x, norm_weight.double(), EPS, proj, base, 4)
        with pytest.raises(ValueError, match=r"x \["):
            fn(x[0], norm_weight, EPS, proj, base, 4)
    with pytest.raises(ValueError, match="max_block_k"):
        norm_conv_prepare_triton(x, norm_weight, EPS, proj, base, 4, max_block_k=24)
    with pytest.raises(ValueError, match="unit channel stride"):
        norm_conv_prepare_triton(x.transpose(1, 2).contiguous().transpose(1, 2), norm_weight, EPS, proj, base, 4)


@pytest.mark.parametrize("planted", ["taps_across_blocks", "zero_centred_weight"])
def test_planted_bugs_are_caught(impl_device, report, planted):
    impl, device = impl_device
    fn = pick(impl, norm_conv_prepare_torch, norm_conv_prepare_triton)
    x, norm_weight, proj, base = make_inputs(3, 8, 64, 16, 2, device, torch.float32, seed=9)
    u_ref, _ = reference(x, norm_weight, proj, base, 16)
    if planted == "taps_across_blocks":  # one long block: row 0 of blocks 1 and 2 reads the block before
        u = fn(x.reshape(1, 24, 64), norm_weight, EPS, proj, base, 16)[0].reshape(3, 8, 64)
    else:
        u = fn(x, 1.0 + norm_weight, EPS, proj, base, 16)[0]
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("u'/float32", u, u_ref, NUMERIC_BOUND[torch.float32])
