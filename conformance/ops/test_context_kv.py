"""fast/kernels/draft/context_kv.py (the torch twin ``context_k_norm_rope_torch`` and the Triton launcher) vs
reference/model/draft.ReferenceDraft.context_kv: the draft's context keys (per-head Qwen3 k_norm with the
weight as stored, then NeoX RoPE over the whole head) and values, ``[L, N, Hkv, D]``.

The reference runs on its own: ``ReferenceDraft.context_kv`` with a stand-in ``self`` holding the config
fields and the per-layer k_proj / v_proj / k_norm weights it reads (as the fast dtype holds them), over
context rows ``[N, C]``. The fast side projects the same rows with the draft's stacked layer-major
[k; v] matrix in the fast dtype (``FastDraft.context_kv_weight``'s layout) and gives the op the GEMM
output as a strided ``[N, L, 2, Hkv, D]`` view into a NaN-poisoned buffer (a read outside the rows
makes the output non-finite).

Shapes: tiny (L = 2, Hkv = 3, D = 20, padded to 32 in the kernel, theta 1e4, positions < 5000) and
the released layout (L = 8, Hkv = 4, D = 128, theta 1e7, positions up to 262143: angles up to 2.6e5
rad). fp32 and bf16; k NUMERIC against the reference (fp32 1e-5, bf16 2e-2), v NUMERIC against it and
EXACT against the GEMM output; the Triton launcher NUMERIC against the torch twin; on the CPU the twin
EXACT against the composition ``FastDraft.context_kv`` ran before it (fast/kernels/dense/rms_norm.rms_norm,
rope_cos_sin, apply_rope, the two transposed copies).

Batch invariance (EXACT): three rows alone and inside a call of 40 rows give the same K/V bits, both
forms, both dtypes, the released head layout (over 2 layers).

Planted bugs: the k_norm weight of the wrong layer (the layers' weights rolled by one), and the
rotation the wrong way round (positions negated), must fail the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from ops_helpers import NUMERIC_BOUND, pick

from dflash2.fast.kernels.draft.context_kv import context_k_norm_rope_torch, context_k_norm_rope_triton
from dflash2.fast.kernels.attention.rope import rope_inv_freq
from dflash2.fast.kernels.dense.rms_norm import rms_norm
from dflash2.fast.kernels.attention.rope import apply_rope, rope_cos_sin
from dflash2.reference.model.draft import ReferenceDraft

EPS = 1e-6
PAD = 5  # poisoned columns either side of the GEMM output rows
DTYPES = [torch.float32, torch.bfloat16]


@dataclass
class Case:
    layers: int
    kv_heads: int
    dim: int
    theta: float
    rows: torch.Tensor  # [N, C] fp32 context rows
    positions: torch.Tensor  # [N] long
    k_proj: torch.Tensor  # [L, Hkv*D, C]
    v_proj: torch.Tensor  # [L, Hkv*D, C]
    k_norm: torch.Tensor  # [L, D] as stored (Qwen3: w, not 1 + w)


def make_case(layers: int, kv_heads: int, dim: int, theta: float, max_position: int, rows: int, seed: int,
              channels: int = 24) -> Case:
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_position, (rows,), generator=gen)
    positions[:3] = torch.tensor([max_position - 1, 0, 1])  # the largest angles, and none
    proj = lambda: torch.randn(layers, kv_heads * dim, channels, generator=gen) * channels ** -0.5  # noqa: E731
    return Case(layers, kv_heads, dim, theta, torch.randn(rows, channels, generator=gen) * 2, positions, proj(),
                proj(), 1.0 + 0.3 * torch.randn(layers, dim, generator=gen))


TINY = dict(layers=2, kv_heads=3, dim=20, theta=1e4, max_position=5000)
RELEASED = dict(layers=8, kv_heads=4, dim=128, theta=1e7, max_position=262144)


def fast_kv(case: Case, device: str, dtype: torch.dtype) -> torch.Tensor:
    """The context GEMM output in the fast dtype as ``[N, L, 2, Hkv, D]``, a view into a NaN-poisoned buffer."""
    weight = torch.stack([case.k_proj, case.v_proj], dim=1).reshape(-1, case.rows.shape[1])  # [L*2*Hkv*D, C]
    out = case.rows.to(device, dtype) @ weight.to(device, dtype).T  # [N, L*2*Hkv*D]
    rows, width = out.shape
    buf = torch.full((rows, width + 2 * PAD), float("nan"), dtype=dtype, device=device)
    buf[:, PAD:PAD + width] = out
    return buf[:, PAD:PAD + width].unflatten(1, (case.layers, 2, case.kv_heads, case.dim))


def reference_kv(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``ReferenceDraft.context_kv`` (fp32, CPU) on the rows and weights as the fast dtype holds them."""
    held = lambda t: t.to(dtype).float()  # noqa: E731
    cfg = SimpleNamespace(num_hidden_layers=case.layers, num_key_value_heads=case.kv_heads, head_dim=case.dim,
                          rms_norm_eps=EPS, rope_theta=case.theta)
    w = {}
    for layer in range(case.layers):
        p = f"layers.{layer}.self_attn."
        w[f"{p}k_proj.weight"], w[f"{p}v_proj.weight"] = held(case.k_proj[layer]), held(case.v_proj[layer])
        w[f"{p}k_norm.weight"] = case.k_norm[layer]
    return ReferenceDraft.context_kv(SimpleNamespace(cfg=cfg, w=w), held(case.rows), case.positions)


def run(impl: str, case: Case, device: str, dtype: torch.dtype, kv: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None, positions: torch.Tensor | None = None):
    kv = fast_kv(case, device, dtype) if kv is None else kv
    k_norm = case.k_norm if k_norm is None else k_norm
    positions = case.positions if positions is None else positions
    fn = pick(impl, context_k_norm_rope_torch, context_k_norm_rope_triton)
    return kv, fn(kv, k_norm.to(device), positions.to(device), EPS, rope_inv_freq(case.dim, case.theta, device))


def old_context_kv_math(kv: torch.Tensor, k_norm: torch.Tensor, positions: torch.Tensor, theta: float):
    """What ``FastDraft.context_kv`` computed after its GEMM before the fused op (rope_cos_sin on kv's device)."""
    n, layers, _, hkv, d = kv.shape
    k = rms_norm(kv[:, :, 0], k_norm[:, None, :], EPS, torch.float32)
    cos, sin = rope_cos_sin(positions, d, theta)
    k = apply_rope(k.reshape(n, layers * hkv, d), cos, sin).to(kv.dtype).reshape(n, layers, hkv, d)
    return k.transpose(0, 1).contiguous(), kv[:, :, 1].transpose(0, 1).contiguous()


@pytest.mark.parametrize("shape", [TINY, RELEASED], ids=["tiny", "released"])
def test_context_k_norm_rope_matches_reference(impl_device, report, shape):
    impl, device = impl_device
    case = make_case(**shape, rows=9, seed=shape["dim"])
    for dtype in DTYPES:
        name = str(dtype)[6:]
        kv, (k, v) = run(impl, case, device, dtype)
        expected = (case.layers, case.rows.shape[0], case.kv_heads, case.dim)
        assert k.shape == v.shape == expected and k.dtype == v.dtype == dtype
        assert k.is_contiguous() and v.is_contiguous()
        k_ref, v_ref = reference_kv(case, dtype)
        report.numeric(f"k/{name}", k, k_ref, NUMERIC_BOUND[dtype])
        report.numeric(f"v/{name}", v, v_ref, NUMERIC_BOUND[dtype])
        assert torch.equal(v, kv[:, :, 1].transpose(0, 1)), "v is not the GEMM output's v heads"
        if impl == "triton":
            _, (k_twin, v_twin) = run("torch", case, device, dtype, kv=kv)
            report.numeric(f"twin-k/{name}", k, k_twin, NUMERIC_BOUND[dtype])
            assert torch.equal(v, v_twin)
        elif device == "cpu":  # the twin is the old composition, bit for bit
            k_old, v_old = old_context_kv_math(kv, case.k_norm, case.positions, case.theta)
            assert torch.equal(k, k_old) and torch.equal(v, v_old), "the torch twin is not the old context_kv math"


def test_context_k_norm_rope_is_batch_invariant(impl_device):
    """Rows 4, 17 and 33 alone (a call of 3 rows) and inside a call of 40: the same K/V bits.

    The released head layout (Hkv = 4, D = 128, theta 1e7) over 2 layers: a program's code depends on
    (Hkv, D) only, and 2 layers keep the interpreter's 2 x 43 x L programs per dtype quick."""
    impl, device = impl_device
    case = make_case(**{**RELEASED, "layers": 2}, rows=40, seed=3)
    picked = torch.tensor([4, 17, 33])
    for dtype in DTYPES:
        kv, (k_all, v_all) = run(impl, case, device, dtype)
        _, (k, v) = run(impl, case, device, dtype, kv=kv[picked.to(device)], positions=case.positions[picked])
        assert torch.equal(k, k_all[:, picked.to(device)]), f"k of a row depends on the other rows ({dtype})"
        assert torch.equal(v, v_all[:, picked.to(device)]), f"v of a row depends on the other rows ({dtype})"


def test_context_k_norm_rope_empty_call(impl_device):
    impl, device = impl_device
    case = make_case(**TINY, rows=4, seed=0)
    kv = fast_kv(case, device, torch.float32)[:0]
    k, v = pick(impl, context_k_norm_rope_torch, context_k_norm_rope_triton)(
        kv, case.k_norm.to(device), case.positions[:0].to(device), EPS, rope_inv_freq(case.dim, case.theta, device))
    assert k.shape == v.shape == (case.layers, 0, case.kv_heads, case.dim)


@pytest.mark.parametrize("planted", ["wrong_layer_norm", "rotation_reversed"])
def test_planted_bugs_are_caught(impl_device, report, planted):
    impl, device = impl_device
    case = make_case(**TINY, rows=9, seed=8)
    if planted == "wrong_layer_norm":
        _, (k, _) = run(impl, case, device, torch.float32, k_norm=case.k_norm.roll(1, dims=0))
    else:
        _, (k, _) = run(impl, case, device, torch.float32, positions=-case.positions)
    k_ref, _ = reference_kv(case, torch.float32)
    with pytest.raises(AssertionError, match="rms-relative"):
        report.numeric(f"planted-{planted}", k, k_ref, NUMERIC_BOUND[torch.float32])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_context_k_norm_rope_refusals(impl):
    fn = pick(impl, context_k_norm_rope_torch, context_k_norm_rope_triton)
    case = make_case(**TINY, rows=4, seed=1)
    kv = fast_kv(case, "cpu", torch.float32)  # [4, 2, 2, 3, 20]
    norms, positions = case.k_norm, case.positions
    bad = [
        ((kv[:, 0], norms, positions), r"kv: shape \[4, 2, 3, 20\].*expected \[N, L, 2, Hkv, D\]"),
        ((torch.zeros(4, 2, 3, 3, 20), norms, positions), r"kv: shape \[4, 2, 3, 3, 20\]"),
        ((torch.zeros(4, 2, 2, 3, 21), torch.ones(2, 21), positions), "D even"),
        ((kv, norms[:, :16], positions), r"k_norms: shape \[2, 16\].*expected fp32 \[2, 20\]"),
        ((kv, norms[:1], positions), r"k_norms: shape \[1, 20\]"),
        ((kv, norms.double(), positions), "k_norms: .*float64"),
        ((kv, norms, positions[:3]), r"positions: shape \[3\].*expected integer \[4\]"),
        ((kv, norms, positions.float()), r"positions: .*float32"),
    ]
    inv_freq = rope_inv_freq(case.dim, case.theta, "cpu")
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            fn(*args, EPS, inv_freq)
    for freq, message in ((inv_freq[:9], r"inv_freq: shape \[9\].*expected fp32 \[10\]"),
                          (inv_freq.double(), r"inv_freq: .*float64")):
        with pytest.raises(ValueError, match=message):
            fn(kv, norms, positions, EPS, freq)
