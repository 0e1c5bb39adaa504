"""The MoE sublayer's four-kernel form (fast/model/moe.py ``FastMoE``): the shared expert stored as
expert E and run as the (k+1)-th pair. Against the sublayer's torch form and the reference's
``SparseMoE`` in fp32 (NUMERIC), with the kernels under Triton's interpreter on the CPU; a shared
expert of another width keeps the torch form; the stacked weights leave the torch form's values as
they were (EXACT: views of the same tensors)."""

from __future__ import annotations

import pytest
import torch

from dflash2.fast.kernels.common.triton_compat import HAS_TRITON
from dflash2.fast.model.moe import FastMoE
from dflash2.fast.model.params import Params
from dflash2.reference.model.moe import SparseMoE
from dflash2.reference.tiny.target import TinyTargetSpec, tiny_target_config
from dflash2.reference.tiny.weights import tiny_target_weights

PREFIX = "layers.1."


def rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())  # a GDN layer's MoE in the tiny MoE layout


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels under the interpreter


def sublayers(shared_width: int, device: str = "cpu"):
    spec = TinyTargetSpec(kind="moe", num_layers=2, full_attention_interval=2, num_experts=9,
                          num_experts_per_tok=3, moe_intermediate_size=20, shared_expert_intermediate_size=shared_width,
                          seed=5)
    cfg = tiny_target_config(spec)
    weights = tiny_target_weights(cfg, seed=5)
    fast = FastMoE(cfg, Params(cfg, weights, torch.float32, device), PREFIX)
    return fast, SparseMoE(cfg, weights, PREFIX), weights, cfg


@pytest.mark.skipif(not HAS_TRITON, reason="the four-kernel form needs triton")
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_four_kernels_match_the_torch_form_and_the_reference(rows):
    fast, ref, _, cfg = sublayers(shared_width=20, device=DEVICE)
    assert fast.shared_as_expert
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    want = ref.forward(x)
    got = fast.forward_four_kernels(x.to(DEVICE)).cpu()
    torch_form = sublayers(shared_width=20)[0].forward(x)  # CPU tensors: the torch form
    assert got.dtype == x.dtype and got.shape == x.shape
    for what, other in (("the reference", want), ("the torch form", torch_form)):
        rel = rms_rel(got, other)
        assert rel <= 1e-5, f"four kernels vs {what}: rms-relative error {rel:.2e} > 1e-5 (NUMERIC, fp32)"


def test_stacked_weights_are_the_checkpoints_values():
    fast, _, weights, cfg = sublayers(shared_width=20)
    p = f"{PREFIX}mlp."
    e = cfg.num_experts
    assert torch.equal(fast.gate_up, weights[f"{p}experts.gate_up_proj"])
    assert torch.equal(fast.down, weights[f"{p}experts.down_proj"])
    assert torch.equal(fast.w_router, weights[f"{p}gate.weight"])
    assert torch.equal(fast.gate_up_with_shared[e], torch.cat([weights[f"{p}shared_expert.gate_proj.weight"],
                                                              weights[f"{p}shared_expert.up_proj.weight"]]))
    assert torch.equal(fast.down_with_shared[e], weights[f"{p}shared_expert.down_proj.weight"])
    assert torch.equal(fast.router_with_shared[e], weights[f"{p}shared_expert_gate.weight"][0])
    assert fast.gate_up.data_ptr() == fast.gate_up_with_shared.data_ptr(), "the routed experts are not a view"


def test_a_shared_expert_of_another_width_keeps_the_torch_form():
    fast, ref, _, cfg = sublayers(shared_width=28)
    assert not fast.shared_as_expert
    x = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(fast.forward(x), ref.forward(x), rtol=1e-5, atol=1e-6)
