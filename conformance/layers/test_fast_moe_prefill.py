"""The MoE sublayer (fast/model/moe.py ``FastMoE``) prefilling a chunk of rows on its GPU forms: the router kernels
and the routed experts' grouped GEMM (fast/kernels/moe/moe_grouped.py), the shared expert beside them. Under
forced_gpu on the CPU (Triton's interpreter), with the op's pair bound lowered so that a chunk small enough for
the interpreter passes it; against the sublayer's torch form and the reference's ``SparseMoE`` in fp32 (NUMERIC),
for a shared expert stored as expert E (then inside the grouped GEMM, as pair k+1) and for one of another width
(beside it)."""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.kernels.common.dispatch import forced_gpu
from dflash2.fast.kernels.common.triton_compat import HAS_TRITON, INTERPRETED
from dflash2.fast.kernels.moe import moe, moe_grouped
from dflash2.fast.model.moe import SHARED_PAIR_ROWS, FastMoE
from dflash2.fast.model.params import Params
from dflash2.reference.model.moe import SparseMoE
from dflash2.reference.tiny.target import TinyTargetSpec, tiny_target_config
from dflash2.reference.tiny.weights import tiny_target_weights

PREFIX = "layers.1."
ROWS = 40  # a prefill chunk: past SHARED_PAIR_ROWS, so the sublayer runs route, the routed experts, the shared one


def rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.mark.skipif(not HAS_TRITON, reason="the GPU forms need triton")
@pytest.mark.skipif(not INTERPRETED, reason="runs the GPU forms on CPU tensors in Triton's interpreter (on a CUDA machine the kernels compile for the device)")
@pytest.mark.parametrize("shared_width", [20, 28], ids=["shared_as_expert", "shared_of_another_width"])
def test_prefill_chunk_goes_through_the_grouped_gemm(monkeypatch, shared_width):
    spec = TinyTargetSpec(kind="moe", num_layers=2, full_attention_interval=2, num_experts=9, num_experts_per_tok=3,
                          moe_intermediate_size=20, shared_expert_intermediate_size=shared_width, seed=5)
    cfg = tiny_target_config(spec)
    weights = tiny_target_weights(cfg, seed=5)
    layer = FastMoE(cfg, Params(cfg, weights, torch.float32, "cpu"), PREFIX)
    x = torch.randn(ROWS, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pairs = ROWS * cfg.num_experts_per_tok
    assert ROWS > SHARED_PAIR_ROWS
    monkeypatch.setattr(moe, "MAX_TRITON_PAIRS", pairs - 1)  # the chunk is past the bound by one pair
    seen = []
    grouped = moe_grouped.moe_experts_grouped
    monkeypatch.setattr(moe_grouped, "moe_experts_grouped",
                        lambda *a, **k: seen.append(a[1].shape) or grouped(*a, **k))
    with forced_gpu():
        got = layer.forward(x)
    # a shared expert stored as expert E rides in the grouped GEMM as pair k+1; one of another width runs beside it
    pairs_per_row = cfg.num_experts_per_tok + int(layer.shared_as_expert)
    assert layer.shared_as_expert == (shared_width == spec.moe_intermediate_size)
    assert seen == [(ROWS, pairs_per_row)], "the experts did not go through the grouped GEMM as expected"
    assert got.dtype == x.dtype and got.shape == x.shape
    torch_form = layer.forward(x)  # CPU tensors, nothing forced: every op's torch form
    for what, other in (("the torch form", torch_form), ("the reference", SparseMoE(cfg, weights, PREFIX).forward(x))):
        rel = rms_rel(got, other)
        assert rel <= 1e-5, f"grouped prefill vs {what}: rms-relative error {rel:.2e} > 1e-5 (NUMERIC, fp32)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels at the real pair bound need CUDA")
@pytest.mark.parametrize("shared_width", [20, 28], ids=["shared_as_expert", "shared_of_another_width"])
def test_prefill_chunk_past_the_pair_bound_on_cuda(shared_width):
    """The same chunk on CUDA at the real ``MAX_TRITON_PAIRS`` (a few rows past it: the compiled grouped GEMM, with
    the shared expert as pair k+1 where it is stored as expert E), fp32, against the reference (NUMERIC)."""
    spec = TinyTargetSpec(kind="moe", num_layers=2, full_attention_interval=2, num_experts=9, num_experts_per_tok=3,
                          moe_intermediate_size=20, shared_expert_intermediate_size=shared_width, seed=5)
    cfg = tiny_target_config(spec)
    weights = tiny_target_weights(cfg, seed=5)
    layer = FastMoE(cfg, Params(cfg, weights, torch.float32, "cuda"), PREFIX)
    rows = moe.MAX_TRITON_PAIRS // cfg.num_experts_per_tok + 5
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    got = layer.forward(x.cuda()).cpu()
    rel = rms_rel(got, SparseMoE(cfg, weights, PREFIX).forward(x))
    assert rel <= 1e-5, f"grouped prefill on CUDA vs the reference: rms-relative error {rel:.2e} > 1e-5 (NUMERIC, fp32)"
