"""fast/kernels/attention/attention_prologue.py (and the model's torch form ``rope.qk_norm_rope_torch``) vs
reference/model/norm.rms_norm + reference/model/rope.apply_rope, and the output gate vs
reference/model/attention.GatedAttention's ``attn * sigmoid(gate)``.

Prologue: N = 7 rows (two of them padding rows that write the trash row) at scattered positions up
to 5000, GQA H = 6 / Hkv = 2 with D = 24 and rotary dim 6 (an odd half of 3 channels), H = 3 /
Hkv = 1 with D = 20 and rotary dim 8 (D padded to 32 in the kernel), and a full rotation (rd = D =
16). The projection rows are a column slice of a NaN-poisoned buffer; the caches are NaN
everywhere. Checks: q and the written K rows NUMERIC against the reference (fp32 1e-5, bf16
2e-2); the written V rows EXACT (a copy); every other cache row still NaN, the trash row aside.

Output gate: attention rows against ``attn * sigmoid(gate)`` in float64, the gate read in place
from the poisoned projection (row stride ``H*2D + 2*Hkv*D``, head stride 2D).

Planted bugs: the rotation's sign flipped (sin negated), and the gate read from the query half of
each head, must fail.

The draft's prologue (``draft_qk_norm_rope``): q and k read as views into NaN-poisoned projection
buffers (k the first half of a [k | v] row, as the draft's fused K/V projection), full rotation
(rd = D, with D = 20 padded to 32 in the kernel), Qwen3 norms with the weights as stored, against
reference/model/draft.qwen3_rms_norm + reference/model/rope.apply_rope (fp32 1e-5, bf16 2e-2) and the
Triton launcher against the torch twin; the planted bug is q's weight used for k.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.attention.attention_prologue import (draft_qk_norm_rope_triton, output_gate_torch, output_gate_triton,
                                                     qk_norm_rope_triton)
from dflash2.fast.kernels.attention.attention_prologue import draft_qk_norm_rope_torch, qk_norm_rope_torch
from dflash2.fast.kernels.attention.rope import rope_cos_sin
from dflash2.reference.model.draft import qwen3_rms_norm
from dflash2.reference.model.norm import rms_norm
from dflash2.reference.model.rope import apply_rope

EPS = 1e-6
THETA = 10000.0
PAD = 3  # poisoned columns either side of the projection rows
DTYPES = [torch.float32, torch.bfloat16]


@dataclass
class Case:
    heads: int
    kv_heads: int
    dim: int
    rotary_dim: int
    qkv: torch.Tensor  # [N, (2H + 2Hkv) D] fp32 values
    positions: torch.Tensor  # [N]
    write_index: torch.Tensor  # [N]; padding rows point at the trash row S - 1
    q_weight: torch.Tensor  # [D] zero-centred, as stored
    k_weight: torch.Tensor
    num_cache_rows: int  # S, the trash row included
    real: torch.Tensor  # [N] bool: not a padding row


def make_case(heads: int, kv_heads: int, dim: int, rotary_dim: int, seed: int, rows: int = 7,
              padding: int = 2) -> Case:
    gen = torch.Generator().manual_seed(seed)
    width = (2 * heads + 2 * kv_heads) * dim
    qkv = torch.randn(rows, width, generator=gen) * 2
    positions = torch.randint(0, 5000, (rows,), generator=gen)
    num_cache_rows = 3 * rows + 1
    write_index = torch.randperm(num_cache_rows - 1, generator=gen)[:rows]
    write_index[rows - padding:] = num_cache_rows - 1
    real = torch.arange(rows) < rows - padding
    q_weight, k_weight = (torch.randn(dim, generator=gen) * 0.3 for _ in range(2))
    return Case(heads, kv_heads, dim, rotary_dim, qkv, positions, write_index, q_weight, k_weight, num_cache_rows,
                real)


def projection(case: Case, device: str, dtype: torch.dtype) -> torch.Tensor:
    rows, width = case.qkv.shape
    buf = torch.full((rows, width + 2 * PAD), float("nan"), dtype=dtype, device=device)
    buf[:, PAD:PAD + width] = case.qkv.to(device, dtype)
    return buf[:, PAD:PAD + width]


def run_prologue(impl: str, case: Case, device: str, dtype: torch.dtype, negate_sin: bool = False):
    qkv = projection(case, device, dtype)
    shape = (case.num_cache_rows, case.kv_heads, case.dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    value_cache = key_cache.clone()
    cos, sin = rope_cos_sin(case.positions.to(device), case.rotary_dim, THETA)
    fn = pick(impl, qk_norm_rope_torch, qk_norm_rope_triton)
    q = fn(qkv, (1.0 + case.q_weight).to(device), (1.0 + case.k_weight).to(device), cos, -sin if negate_sin else sin,
           EPS, case.heads, case.kv_heads, key_cache, value_cache, case.write_index.to(device))
    return qkv, q, key_cache, value_cache


def expected_qk(case: Case, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on the projection as the model dtype holds it: q [N, H, D], k [N, Hkv, D] fp32."""
    rows, h, hkv, d = qkv.shape[0], case.heads, case.kv_heads, case.dim
    x = qkv.float().cpu()
    q = x[:, :2 * h * d].reshape(rows, h, 2 * d)[..., :d]
    k = x[:, 2 * h * d:(2 * h + hkv) * d].reshape(rows, hkv, d)
    rope = lambda t, w: apply_rope(rms_norm(t, w, EPS), case.positions, case.rotary_dim, THETA)  # noqa: E731
    return rope(q, case.q_weight), rope(k, case.k_weight)


def check_prologue(impl: str, case: Case, device: str, dtype: torch.dtype, report, negate_sin: bool = False):
    qkv, q, key_cache, value_cache = run_prologue(impl, case, device, dtype, negate_sin)
    name = str(dtype)[6:]
    assert q.dtype == dtype and q.shape == (qkv.shape[0], case.heads, case.dim)
    q_ref, k_ref = expected_qk(case, qkv)
    report.numeric(f"q/{name}", q, q_ref, NUMERIC_BOUND[dtype])
    rows = case.write_index[case.real]
    report.numeric(f"k/{name}", key_cache.cpu()[rows], k_ref[case.real], NUMERIC_BOUND[dtype])
    h, hkv, d = case.heads, case.kv_heads, case.dim
    v = qkv.cpu()[:, (2 * h + hkv) * d:].reshape(-1, hkv, d)
    assert torch.equal(value_cache.cpu()[rows], v[case.real]), "V rows are not the projection's V"
    untouched = torch.ones(case.num_cache_rows, dtype=torch.bool)
    untouched[rows] = False
    untouched[-1] = False  # the trash row takes the padding rows' writes
    for cache in (key_cache, value_cache):
        assert cache.cpu()[untouched].isnan().all(), "a cache row no real row maps to was written"
    return q, key_cache, value_cache


SHAPES = [(6, 2, 24, 6), (3, 1, 20, 8), (2, 2, 16, 16)]  # H, Hkv, D, rotary dim


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}-rd{s[3]}")
def test_qk_norm_rope_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    case = make_case(*shape, seed=sum(shape))
    for dtype in DTYPES:
        q, key_cache, _ = check_prologue(impl, case, device, dtype, report)
        if impl == "triton" and (dtype == torch.float32 or device == "cuda"):
            _, q_twin, key_twin, _ = run_prologue("torch", case, device, dtype)
            rows = case.write_index[case.real].to(device)
            report.numeric(f"twin-q/{str(dtype)[6:]}", q, q_twin, NUMERIC_BOUND[dtype])
            report.numeric(f"twin-k/{str(dtype)[6:]}", key_cache[rows], key_twin[rows], NUMERIC_BOUND[dtype])


def test_qk_norm_rope_refusals():
    case = make_case(6, 2, 24, 6, seed=0)
    qkv = case.qkv
    cache = torch.zeros(case.num_cache_rows, 2, 24)
    cos, sin = rope_cos_sin(case.positions, 6, THETA)
    scale = torch.ones(24)
    with pytest.raises(ValueError, match="qkv: "):
        qk_norm_rope_triton(qkv[:, 1:], scale, scale, cos, sin, EPS, 6, 2, cache, cache, case.write_index)
    with pytest.raises(ValueError, match="key_cache: "):
        qk_norm_rope_triton(qkv, scale, scale, cos, sin, EPS, 6, 2, cache[:, :1], cache, case.write_index)
    with pytest.raises(ValueError, match="k_scale: "):
        qk_norm_rope_triton(qkv, scale, scale[:20], cos, sin, EPS, 6, 2, cache, cache, case.write_index)
    with pytest.raises(ValueError, match="cos: "):
        qk_norm_rope_triton(qkv, scale, scale, cos[:3], sin, EPS, 6, 2, cache, cache, case.write_index)


def test_planted_bug_rotation_sign_is_caught(impl_device, report):
    """Rotating the wrong way (sin negated: x1 cos + x2 sin, x2 cos - x1 sin) fails."""
    impl, device = impl_device
    case = make_case(6, 2, 24, 6, seed=5)
    with pytest.raises(AssertionError, match="rms-relative"):
        check_prologue(impl, case, device, torch.float32, report, negate_sin=True)


def run_gate(impl: str, case: Case, device: str, dtype: torch.dtype, offset: int):
    """The gate is each head's second half in the projection (``offset`` D: the query half, a planted bug)."""
    h, d = case.heads, case.dim
    qkv = projection(case, device, dtype)
    rows = qkv.shape[0]
    gate = qkv[:, :2 * h * d].view(rows, h, 2 * d)[..., d - offset:2 * d - offset]
    attn = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    out = pick(impl, output_gate_torch, output_gate_triton)(attn, gate)
    expected = attn.double().cpu() * torch.sigmoid(qkv[:, :2 * h * d].view(rows, h, 2 * d)[..., d:].double().cpu())
    return out, expected.reshape(rows, h * d)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: f"H{s[0]}-D{s[2]}")
def test_output_gate_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    case = make_case(*shape, seed=11)
    for dtype in DTYPES:
        out, expected = run_gate(impl, case, device, dtype, offset=0)
        assert out.dtype == dtype and out.shape == expected.shape
        report.numeric(f"gate/{str(dtype)[6:]}", out, expected, NUMERIC_BOUND[dtype])


def test_planted_bug_gate_from_the_query_half_is_caught(impl_device, report):
    impl, device = impl_device
    case = make_case(6, 2, 24, 6, seed=12)
    out, expected = run_gate(impl, case, device, torch.float32, offset=case.dim)
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("gate/planted", out, expected, NUMERIC_BOUND[torch.float32])


DRAFT_SHAPES = [(8, 2, 32), (3, 1, 20), (2, 2, 16)]  # H, Hkv, D (rotary dim = D)


def run_draft_prologue(impl: str, heads: int, kv_heads: int, dim: int, device: str, dtype: torch.dtype,
                       swap_weights: bool = False):
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    rows = 9
    positions = torch.randint(0, 5000, (rows,), generator=gen)
    q_cols, kv_cols = heads * dim, 2 * kv_heads * dim
    q_buf = torch.full((rows, q_cols + 2 * PAD), float("nan"))
    kv_buf = torch.full((rows, kv_cols + 2 * PAD), float("nan"))
    q_buf[:, PAD:PAD + q_cols] = torch.randn(rows, q_cols, generator=gen) * 2
    kv_buf[:, PAD:PAD + kv_cols] = torch.randn(rows, kv_cols, generator=gen) * 2
    q_buf, kv_buf = q_buf.to(device, dtype), kv_buf.to(device, dtype)
    q = q_buf[:, PAD:PAD + q_cols].view(rows, heads, dim)
    k = kv_buf[:, PAD:PAD + kv_heads * dim].view(rows, kv_heads, dim)
    q_weight, k_weight = (1.0 + 0.3 * torch.randn(dim, generator=gen) for _ in range(2))
    # the op takes cos/sin as inputs: computed on the host, where the reference computes its angles (the
    # GPU's pow rounds inv_freq an ulp apart, which at p ~ 5000 moves the fp32 result past its bound)
    cos, sin = (t.to(device) for t in rope_cos_sin(positions, dim, THETA))
    fn = pick(impl, draft_qk_norm_rope_torch, draft_qk_norm_rope_triton)
    got = fn(q, k, q_weight.to(device), (q_weight if swap_weights else k_weight).to(device), cos, sin, EPS)
    rope = lambda t, w: apply_rope(qwen3_rms_norm(t.float().cpu(), w, EPS), positions, dim, THETA)  # noqa: E731
    return got, (rope(q, q_weight), rope(k, k_weight)), (q, k, q_weight.to(device), k_weight.to(device), cos, sin)


@pytest.mark.parametrize("shape", DRAFT_SHAPES, ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_draft_qk_norm_rope_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    for dtype in DTYPES:
        (q, k), (q_ref, k_ref), inputs = run_draft_prologue(impl, *shape, device, dtype)
        name = str(dtype)[6:]
        assert q.dtype == k.dtype == dtype and q.shape == q_ref.shape and k.shape == k_ref.shape
        report.numeric(f"draft-q/{name}", q, q_ref, NUMERIC_BOUND[dtype])
        report.numeric(f"draft-k/{name}", k, k_ref, NUMERIC_BOUND[dtype])
        if impl == "triton":
            q_twin, k_twin = draft_qk_norm_rope_torch(*inputs, EPS)
            report.numeric(f"twin-q/{name}", q, q_twin, NUMERIC_BOUND[dtype])
            report.numeric(f"twin-k/{name}", k, k_twin, NUMERIC_BOUND[dtype])


def test_planted_bug_draft_k_with_the_q_weight_is_caught(impl_device, report):
    impl, device = impl_device
    (_, k), (_, k_ref), _ = run_draft_prologue(impl, 8, 2, 32, device, torch.float32, swap_weights=True)
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric("draft-k/float32", k, k_ref, NUMERIC_BOUND[torch.float32])
