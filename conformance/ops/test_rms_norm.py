"""fast/kernels/dense/rms_norm.py (and the model's torch forms ``add_rms_norm_torch``, ``gated_rms_norm_torch``)
vs reference/model/norm.rms_norm and gated_rms_norm.

Residual add + norm: N in {1, 3, 7} rows of C in {40, 37, 200} channels (C = 37 and 200 also walked
in chunks of 16 and 64), x and the update read as column slices of wider NaN-poisoned buffers (a
read outside the row makes the output non-finite), with and without an update, output in the
model dtype and in fp32. The reference adds in fp32; the fast side rounds the sum to the model
dtype first, so bf16 sits inside its NUMERIC bound, fp32 to rounding. The residual the kernel
writes is EXACT against the torch twin's ``x + y`` (one rounding of the same fp32 sum) where the
rounding is the hardware's; Triton 3.6's interpreter rounds bf16 toward zero, so on the CPU only
fp32 is held bitwise.

Gated norm: ``o [N, Hv, Dv]`` fp32 and the gate read in place from a poisoned projection slice
(row stride > Hv * Dv), Hv in {3, 4}, Dv in {12, 8, 20}; output in the model dtype.

Planted bugs: the raw zero-centred weight w used as the scale (instead of 1 + w), and the gate read
one column off in the projection, must fail the comparison.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.dense.rms_norm import add_rms_norm_triton, gated_rms_norm_triton
from dflash2.fast.kernels.dense.rms_norm import add_rms_norm_torch, gated_rms_norm_torch
from dflash2.reference.model.norm import gated_rms_norm, rms_norm

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def poisoned_rows(values: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """``values [N, C]`` as the column slice ``[:, pad:pad+C]`` of a NaN buffer ``[N, C + 2 pad]``."""
    rows, channels = values.shape
    buf = torch.full((rows, channels + 2 * pad), float("nan"), dtype=values.dtype, device=values.device)
    buf[:, pad:pad + channels] = values
    return buf[:, pad:pad + channels]


def add_norm_inputs(rows: int, channels: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=gen) * 3
    y = torch.randn(rows, channels, generator=gen)
    weight = torch.randn(channels, generator=gen) * 0.2  # zero-centred, as stored
    return x, y, weight


def check_add_norm(impl, device, dtype, out_dtype, x, y, weight, report, scale=None, **kwargs):
    """Run the implementation on poisoned slices of x and y (``scale`` default 1 + w) and hold it to the reference."""
    xs = poisoned_rows(x.to(device, dtype))
    ys = None if y is None else poisoned_rows(y.to(device, dtype))
    scale = (1.0 + weight if scale is None else scale).to(device)
    h, out = pick(impl, add_rms_norm_torch, add_rms_norm_triton)(xs, ys, scale, EPS, out_dtype, **kwargs)
    x_in, y_in = xs.double().cpu(), None if ys is None else ys.double().cpu()  # as the model dtype holds them
    h_ref = x_in if y_in is None else x_in + y_in
    name = f"{str(dtype)[6:]}->{str(out_dtype)[6:]}"
    assert h.dtype == dtype and out.dtype == out_dtype and out.shape == x.shape
    report.numeric(f"sum/{name}", h, h_ref, NUMERIC_BOUND[dtype])
    report.numeric(f"norm/{name}", out, rms_norm(h_ref, weight.double(), EPS), NUMERIC_BOUND[dtype])
    if y is None:
        assert h.data_ptr() == xs.data_ptr(), "without an update the residual is x itself"
    return h, out, xs, ys


SHAPES = [(1, 40), (3, 37), (7, 200)]


@pytest.mark.parametrize("rows,channels", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("with_update", [True, False], ids=["add", "norm-only"])
def test_add_rms_norm_matches_reference(impl_device, report, rows, channels, with_update):
    impl, device = impl_device
    x, y, weight = add_norm_inputs(rows, channels, seed=rows * channels)
    y = y if with_update else None
    chunkings = [{}] + ([{"max_block": 16}, {"max_block": 64}] if impl == "triton" and channels > 16 else [])
    for dtype in DTYPES:
        for out_dtype in (dtype, torch.float32):
            for chunking in chunkings:
                h, out, xs, ys = check_add_norm(impl, device, dtype, out_dtype, x, y, weight, report, **chunking)
                if impl == "triton" and y is not None and (dtype == torch.float32 or device == "cuda"):
                    h_twin, out_twin = add_rms_norm_torch(xs, ys, (1.0 + weight).to(device), EPS, out_dtype)
                    assert torch.equal(h, h_twin), "the residual add differs from the torch twin's x + y"
                    report.numeric(f"twin/{str(dtype)[6:]}", out, out_twin, NUMERIC_BOUND[dtype])


def test_add_rms_norm_refusals():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="y: "):
        add_rms_norm_triton(x, torch.randn(3, 8, dtype=torch.float64), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="scale: "):
        add_rms_norm_triton(x, None, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="x: "):
        add_rms_norm_triton(x.t(), None, torch.ones(3), EPS)
    with pytest.raises(ValueError, match="max_block=12"):
        add_rms_norm_triton(x, None, torch.ones(8), EPS, max_block=12)


def test_planted_bug_raw_weight_as_scale_is_caught(impl_device, report):
    """Scaling by w instead of 1 + w (the zero-centred weight read as a plain one) fails."""
    impl, device = impl_device
    x, y, weight = add_norm_inputs(3, 37, seed=1)
    with pytest.raises(AssertionError, match="rms-relative"):
        check_add_norm(impl, device, torch.float32, torch.float32, x, y, weight, report, scale=weight)


def gated_inputs(rows: int, heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(rows, heads, dim, generator=gen)
    z = torch.randn(rows, heads, dim, generator=gen) * 2
    weight = 1.0 + torch.randn(dim, generator=gen) * 0.2  # applied as stored
    return o, z, weight


def run_gated(impl: str, o, z, weight, device, dtype, offset: int = 0):
    """The gate is read in place from a poisoned projection slice (row stride > Hv * Dv); ``offset``
    shifts that slice by some columns (a planted bug)."""
    rows, heads, dim = o.shape
    proj = poisoned_rows(torch.cat([torch.randn(rows, 5), z.reshape(rows, -1)], dim=1).to(device, dtype), pad=2)
    gate = proj[:, 5 + offset:5 + offset + heads * dim].view(rows, heads, dim)
    fn = pick(impl, gated_rms_norm_torch, gated_rms_norm_triton)
    return fn(o.to(device), gate, weight.to(device), EPS, dtype), gate


@pytest.mark.parametrize("rows,heads,dim", [(1, 4, 12), (3, 3, 8), (5, 4, 20)], ids=lambda v: str(v))
def test_gated_rms_norm_matches_reference(impl_device, report, rows, heads, dim):
    impl, device = impl_device
    o, z, weight = gated_inputs(rows, heads, dim, seed=rows * 10 + dim)
    for dtype in DTYPES:
        out, gate = run_gated(impl, o, z, weight, device, dtype)
        assert out.dtype == dtype and out.shape == o.shape
        expected = gated_rms_norm(o.double(), gate.double().cpu(), weight.double(), EPS)
        report.numeric(f"gated/{str(dtype)[6:]}", out, expected, NUMERIC_BOUND[dtype])
        if impl == "triton" and (dtype == torch.float32 or device == "cuda"):
            twin = gated_rms_norm_torch(o.to(device), gate, weight.to(device), EPS, dtype)
            report.numeric(f"twin/{str(dtype)[6:]}", out, twin, NUMERIC_BOUND[dtype])


def test_gated_rms_norm_refusals():
    o = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm_triton(o, o[:, :2], torch.ones(8), EPS, torch.float32)
    with pytest.raises(ValueError, match="weight: "):
        gated_rms_norm_triton(o, o, torch.ones(8, dtype=torch.float64), EPS, torch.float32)


def test_planted_bug_gate_read_one_column_off_is_caught(impl_device, report):
    """The gate read one column to the left in the projection (an off-by-one split) fails."""
    impl, device = impl_device
    o, z, weight = gated_inputs(3, 4, 12, seed=2)
    out, _ = run_gated(impl, o, z, weight, device, torch.float32, offset=-1)
    expected = gated_rms_norm(o.double(), z.double(), weight.double(), EPS)
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("gated/planted", out, expected, NUMERIC_BOUND[torch.float32])
