"""fast/kernels/draft/conv_finish_norm.py (the Triton launcher and the torch twin) vs the reference's conv finish
+ residual add + Qwen3 norm: reference/model/conv.grouped_dynamic_conv block by block, then
reference/model/draft.qwen3_rms_norm of ``r + y``: NUMERIC (fp32 1e-5, bf16 2e-2), h and u both.

Shapes: the draft's K = 2, G = 16 over B = 3 blocks of 8 rows; K = 3 with G = 4 and C/G = 5 groups
(C = 20, padded to 32 in the kernel); more taps than rows (K = 4, S = 3). o and the residual are views
into NaN-poisoned buffers (row strides wider than C), base and delta side 1 of ``[2, K, C]`` and
``[B, S, 2, K, C/G]`` tensors whose side 0 is NaN, so a read outside a row or of the wrong side makes
the output non-finite. The norm's output in the model dtype and in fp32.

Exactness: the torch twin is the two calls it replaces in the engine's CPU path
(``grouped_dynamic_conv_torch`` with the residual, then ``add_rms_norm_torch`` with no update) bit for
bit; the Triton kernel is the two Triton kernels it replaces (``grouped_dynamic_conv_triton``, then
``add_rms_norm_triton``) bit for bit: on CUDA (there also at the real C = 2048 and 5120, whose rows
reduce over 4 and 16 warps), and under the interpreter, which runs both through the same numpy casts.
The Triton kernel is held to the torch twin at the NUMERIC bound (Triton 3.6's interpreter rounds bf16
toward zero, torch to nearest; on CUDA the conv's fp32 multiply-add may contract to an FMA).

Planted bugs: one conv over all B*S rows (taps crossing block starts) and the zero-centred ``1 + w``
as the scale must fail the comparison; the norm of the un-rounded fp32 ``r + y`` sits inside the bf16
NUMERIC bound but is not the composition's bits, which the exact checks catch. On CUDA a graph replay
equals the eager call bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.draft.conv_finish_norm import (MAX_BLOCK, conv_finish_norm, conv_finish_norm_torch,
                                                   conv_finish_norm_triton)
from dflash2.fast.kernels.draft.dynamic_conv import grouped_dynamic_conv_torch, grouped_dynamic_conv_triton
from dflash2.fast.kernels.dense.rms_norm import add_rms_norm_triton
from dflash2.fast.kernels.dense.rms_norm import add_rms_norm_torch, rms_norm
from dflash2.reference.model.conv import grouped_dynamic_conv
from dflash2.reference.model.draft import qwen3_rms_norm

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(3, 8, 64, 16, 2), (2, 5, 20, 4, 3), (2, 3, 12, 4, 4)]  # B, S, C, G, K


def poisoned(values: torch.Tensor, pad: int) -> torch.Tensor:
    """``values [B, S, C]`` as the column slice ``[:, pad:pad+C]`` of NaN rows ``[B*S, C + 2 pad + 1]``."""
    batch, rows, channels = values.shape
    buf = torch.full((batch * rows, channels + 2 * pad + 1), float("nan"), dtype=values.dtype, device=values.device)
    buf[:, pad:pad + channels] = values.reshape(batch * rows, channels)
    return buf[:, pad:pad + channels].view(batch, rows, channels)


def make_inputs(batch: int, rows: int, channels: int, group: int, taps: int, device: str, dtype: torch.dtype,
                seed: int):
    """(o, base side 1 [K, C], delta side 1 [B, S, K, C/G], residual, weight fp32 [C]); side 0 of both is NaN."""
    gen = torch.Generator().manual_seed(seed)
    o = poisoned(torch.randn(batch, rows, channels, generator=gen).to(device, dtype), pad=3)
    residual = poisoned((torch.randn(batch, rows, channels, generator=gen) * 2).to(device, dtype), pad=5)
    base = torch.randn(2, taps, channels, generator=gen) * 0.5
    delta = torch.randn(batch, rows, 2, taps, channels // group, generator=gen) * 0.2
    base[0], delta[:, :, 0] = float("nan"), float("nan")
    weight = 1.0 + torch.randn(channels, generator=gen) * 0.2  # Qwen3's norm weight, applied as stored
    return o, base.to(device, dtype)[1], delta.to(device, dtype)[:, :, 1], residual, weight.to(device)


def reference(o, base, delta, group, residual, weight):
    """(h, u) of the reference in fp32 from the inputs as the model dtype holds them (h not rounded)."""
    o, base, delta, residual = (t.float().cpu() for t in (o, base, delta, residual))
    y = torch.stack([grouped_dynamic_conv(o[b], base, delta[b], group) for b in range(o.shape[0])])
    h = residual + y
    return h, qwen3_rms_norm(h, weight.cpu(), EPS)


def two_kernels(impl: str, o, base, delta, group, residual, scale, out_dtype):
    """The two calls the fused op replaces, in the implementation ``impl``."""
    conv = pick(impl, grouped_dynamic_conv_torch, grouped_dynamic_conv_triton)
    norm = pick(impl, add_rms_norm_torch, add_rms_norm_triton)
    h = conv(o, base, delta, group, residual)
    return h, norm(h.reshape(-1, h.shape[-1]), None, scale, EPS, out_dtype)[1].view(h.shape)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-S{s[1]}-C{s[2]}-G{s[3]}-K{s[4]}")
def test_conv_finish_norm_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    batch, rows, channels, group, taps = shape
    fn = pick(impl, conv_finish_norm_torch, conv_finish_norm_triton)
    for dtype in DTYPES:
        o, base, delta, residual, weight = make_inputs(*shape, device, dtype, seed=sum(shape))
        h_ref, u_ref = reference(o, base, delta, group, residual, weight)
        for out_dtype in dict.fromkeys((dtype, torch.float32)):  # once for fp32
            name = f"{str(dtype)[6:]}->{str(out_dtype)[6:]}"
            h, u = fn(o, base, delta, group, residual, weight, EPS, out_dtype)
            assert h.dtype == dtype and u.dtype == out_dtype and h.shape == u.shape == o.shape
            assert h.is_contiguous() and u.is_contiguous()
            report.numeric(f"h/{name}", h, h_ref, NUMERIC_BOUND[dtype])
            report.numeric(f"u/{name}", u, u_ref, NUMERIC_BOUND[dtype])
            h_two, u_two = two_kernels(impl, o, base, delta, group, residual, weight, out_dtype)
            assert torch.equal(h, h_two), f"{name}: h differs from the conv kernel's residual + y"
            assert torch.equal(u, u_two), f"{name}: u differs from the norm kernel's on that h"
            if impl == "triton":
                h_twin, u_twin = conv_finish_norm_torch(o, base, delta, group, residual, weight, EPS, out_dtype)
                report.numeric(f"twin-h/{name}", h, h_twin, NUMERIC_BOUND[dtype])
                report.numeric(f"twin-u/{name}", u, u_twin, NUMERIC_BOUND[dtype])


def test_conv_finish_norm_dispatch_on_cpu():
    """The entry point keeps the torch twin on CPU tensors: the engine's CPU values, unchanged."""
    o, base, delta, residual, weight = make_inputs(3, 8, 64, 16, 2, "cpu", torch.bfloat16, seed=3)
    got = conv_finish_norm(o, base, delta, 16, residual, weight, EPS, torch.bfloat16)
    expected = two_kernels("torch", o, base, delta, 16, residual, weight, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_conv_finish_norm_refusals_and_empty(impl_device):
    impl, device = impl_device
    fn = pick(impl, conv_finish_norm_torch, conv_finish_norm_triton)
    o, base, delta, residual, weight = make_inputs(2, 4, 16, 4, 2, device, torch.float32, seed=0)
    with pytest.raises(ValueError, match="residual: None"):
        fn(o, base, delta, 4, None, weight, EPS, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        fn(o, base, delta, 4, residual[:1], weight, EPS, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        fn(o, base, delta, 4, residual.double(), weight, EPS, torch.float32)
    with pytest.raises(ValueError, match="group_size"):
        fn(o, base, delta, 5, residual, weight, EPS, torch.float32)
    with pytest.raises(ValueError, match="delta"):
        fn(o, base, delta[:, :, :1], 4, residual, weight, EPS, torch.float32)
    with pytest.raises(ValueError, match="scale: "):
        fn(o, base, delta, 4, residual, weight.double(), EPS, torch.float32)
    with pytest.raises(ValueError, match="scale: "):
        fn(o, base, delta, 4, residual, weight[:8], EPS, torch.float32)
    empty = fn(o[:0], base, delta[:0], 4, residual[:0], weight, EPS, torch.bfloat16)
    assert empty[0].shape == empty[1].shape == (0, 4, 16) and empty[1].dtype == torch.bfloat16
    if impl == "torch":
        return
    with pytest.raises(ValueError, match="o: strides"):
        fn(o.transpose(1, 2).contiguous().transpose(1, 2), base, delta, 4, residual, weight, EPS, torch.float32)
    with pytest.raises(ValueError, match="delta: strides"):
        fn(o, base, delta.transpose(2, 3).contiguous().transpose(2, 3), 4, residual, weight, EPS, torch.float32)
    wide = torch.zeros(1, 1, 2 * MAX_BLOCK, device=device)
    with pytest.raises(ValueError, match=f"at most {MAX_BLOCK} channels"):
        fn(wide, torch.zeros(2, 2 * MAX_BLOCK, device=device), torch.zeros(1, 1, 2, 2 * MAX_BLOCK // 16,
           device=device), 16, wide, torch.ones(2 * MAX_BLOCK, device=device), EPS, torch.float32)


def test_planted_bug_taps_across_block_starts_are_caught(impl_device, report):
    impl, device = impl_device
    o, base, delta, residual, weight = make_inputs(3, 8, 64, 16, 2, device, torch.float32, seed=9)
    fn = pick(impl, conv_finish_norm_torch, conv_finish_norm_triton)
    h, u = fn(o.reshape(1, 24, 64), base, delta.reshape(1, 24, 2, 4), 16, residual.reshape(1, 24, 64), weight, EPS,
              torch.float32)  # one long block
    h_ref, u_ref = reference(o, base, delta, 16, residual, weight)
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("h/planted", h.view(3, 8, 64), h_ref, NUMERIC_BOUND[torch.float32])
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("u/planted", u.view(3, 8, 64), u_ref, NUMERIC_BOUND[torch.float32])


def test_planted_bug_zero_centred_scale_is_caught(impl_device, report):
    """Qwen3's norm applies the stored weight; the target's ``1 + w`` convention fails."""
    impl, device = impl_device
    o, base, delta, residual, weight = make_inputs(3, 8, 64, 16, 2, device, torch.float32, seed=10)
    _, u = pick(impl, conv_finish_norm_torch, conv_finish_norm_triton)(o, base, delta, 16, residual, 1.0 + weight,
                                                                        EPS, torch.float32)
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("u/planted", u, reference(o, base, delta, 16, residual, weight)[1], NUMERIC_BOUND[torch.float32])


def test_planted_bug_norm_of_the_unrounded_sum_is_caught(report):
    """In bf16, normalising the fp32 ``r + y`` instead of the rounded h is within NUMERIC but not the bits
    of the two calls, so only the exact checks above catch it."""
    o, base, delta, residual, weight = make_inputs(3, 8, 64, 16, 2, "cpu", torch.bfloat16, seed=11)
    y = grouped_dynamic_conv_torch(o, base, delta, 16)
    planted = rms_norm(residual.float() + y.float(), weight, EPS, torch.bfloat16)
    _, u = conv_finish_norm_torch(o, base, delta, 16, residual, weight, EPS, torch.bfloat16)
    report.numeric("u/planted", planted, u, NUMERIC_BOUND[torch.bfloat16])
    assert not torch.equal(planted, u), "the planted un-rounded norm has the composition's bits: the check is blind"


CUDA_SHAPES = [(4, 16, 2048, 16, 2), (4, 16, 5120, 16, 2), (1, 8, 5120, 32, 4)]  # the real rows: 4 and 16 warps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: f"B{s[0]}-S{s[1]}-C{s[2]}-G{s[3]}-K{s[4]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_finish_norm_cuda_large_rows_equal_the_two_kernels(report, shape, dtype):
    """At the real widths the fused row reduces over the norm kernel's warps: its bits, and the reference's values."""
    o, base, delta, residual, weight = make_inputs(*shape, "cuda", dtype, seed=shape[2])
    h, u = conv_finish_norm_triton(o, base, delta, shape[3], residual, weight, EPS, dtype)
    h_two, u_two = two_kernels("triton", o, base, delta, shape[3], residual, weight, dtype)
    assert torch.equal(h, h_two) and torch.equal(u, u_two), f"{dtype} {shape}: differs from the two kernels"
    h_ref, u_ref = reference(o, base, delta, shape[3], residual, weight)
    report.numeric(f"u/{str(dtype)[6:]}", u, u_ref, NUMERIC_BOUND[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_finish_norm_cuda_graph_replay_is_exact(dtype):
    """The draft's rows (B = 4 blocks of 16, C = 2048 and 5120): a replay equals the eager call."""
    for shape in CUDA_SHAPES[:2]:
        o, base, delta, residual, weight = make_inputs(*shape, "cuda", dtype, seed=shape[2] + 1)
        eager = conv_finish_norm(o, base, delta, shape[3], residual, weight, EPS, dtype)  # compiles outside
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = conv_finish_norm(o, base, delta, shape[3], residual, weight, EPS, dtype)
        for _ in range(2):
            for t in captured:
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(c, e) for c, e in zip(captured, eager)), f"{dtype} {shape}: replay differs"
