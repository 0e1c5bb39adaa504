"""Tiny random Qwen3.5 targets built with transformers, as oracles for the reference.

Shared by the tests under tests/model/target (through conftest.py fixtures) and importable by other
tests that need a small target with canonical weights. Sizes are deliberately odd: hidden 40,
vocab 97, head_dim 12 with partial rotary 0.5 (rotary dim 6), value heads > key heads.

Every parameter is redrawn from a seeded generator: zero-centred norm weights away from zero (so
``1 + w`` matters), the GDN output norm around one, non-trivial ``A_log`` and ``dt_bias``, router
weights wide enough that top-k choices are clear, projections scaled by ``1/sqrt(fan_in)``.
"""

from __future__ import annotations

import importlib.util
import math

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig, parse_target_config
from dflash2.reference.formats.weights import expected_target_shapes

COMMON = dict(
    vocab_size=97,
    hidden_size=40,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=10,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
DENSE = dict(COMMON, num_hidden_layers=5, intermediate_size=56,
             layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                          "full_attention"])
MOE = dict(COMMON, num_hidden_layers=4, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=20,
           layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def assert_pure_torch_gdn() -> None:
    """transformers must take its pure-PyTorch GDN path (no flash-linear-attention, no causal_conv1d)."""
    for package in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(package) is None, f"{package} is installed: the oracle would not be pure torch"


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """A random value for a canonical (or HF) tensor name, scaled by what the tensor does."""
    def uniform(lo: float, hi: float) -> Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=gen)

    if name.endswith("linear_attn.norm.weight"):
        return uniform(0.5, 1.5)  # applied as w
    if name.endswith("norm.weight"):
        return uniform(-0.5, 0.5)  # applied as 1 + w
    if name.endswith("A_log"):
        return uniform(0.05, 3.0).log()
    if name.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    if name.endswith("mlp.gate.weight"):
        return 3.0 * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def build_hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 ``Qwen3_5ForCausalLM`` (kind 'dense') or ``Qwen3_5MoeForCausalLM`` ('moe'), eager attention."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    assert_pure_torch_gdn()
    if kind == "dense":
        config, model_cls = Qwen3_5TextConfig(**DENSE), Qwen3_5ForCausalLM
    elif kind == "moe":
        config, model_cls = Qwen3_5MoeTextConfig(**MOE), Qwen3_5MoeForCausalLM
    else:
        raise ValueError(f"kind {kind!r}: expected 'dense' or 'moe'")
    config._attn_implementation = "eager"
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), gen))
    return model


def canonical_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """The HF state dict under canonical names: ``model.`` stripped, ``lm_head.weight`` kept."""
    weights = {}
    for name, tensor in model.state_dict().items():
        canonical = name.removeprefix("model.")
        weights[canonical] = tensor.detach().clone()
    return weights


def target_config(model: torch.nn.Module, mtp: bool = False) -> TargetConfig:
    """Our TargetConfig parsed from the HF model's config (optionally claiming one MTP layer)."""
    raw = model.config.to_dict()
    if mtp:
        raw["mtp_num_hidden_layers"] = 1
    return parse_target_config(raw)


def random_mtp_weights(cfg: TargetConfig, seed: int) -> dict[str, Tensor]:
    """Random tensors for every ``mtp.*`` canonical name (no checkpoint ships a tiny MTP head)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: random_tensor(name, shape, gen)
            for name, shape in expected_target_shapes(cfg).items() if name.startswith("mtp.")}


def rms_rel_err(actual: Tensor, expected: Tensor) -> float:
    """RMS-relative error ``||actual - expected|| / ||expected||``."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())
