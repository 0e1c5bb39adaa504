"""Random canonical weights for tiny targets, and their on-disk layout (``reference/tiny/target.py`` writes them).

Weights are a pure function of (config, seed), drawn in canonical order from one
``torch.Generator`` and then laid out on disk, so every layout of one spec holds the same values.
Scales keep a random model non-degenerate:

- linear layers ``N(0, gain^2 / fan_in)``: unit-RMS activations after each pre-norm, with gain 2
  on the projections into the residual stream so the layers outweigh the token's own embedding
  (with tied embeddings a weaker stack makes each token predict itself, and greedy decoding then
  repeats one token forever);
- embedding and head ``N(0, 9 / C)``: logits of standard deviation about 3 after the final norm;
- zero-centred norm weights ``N(0, 0.2^2)``, so ``1 + w`` and ``w`` differ visibly; the GDN
  output norm (applied as ``w``) ``1 + N(0, 0.2^2)``;
- ``A_log = log U(1, 16)``, and ``dt_bias`` the inverse softplus of a log-uniform step in
  [1e-3, 1e-1] (the Mamba initialisation).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..formats.checkpoint import INDEX_FILE, SINGLE_FILE, disk_tensor_name
from ..formats.config import TargetConfig
from ..formats.weights import expected_target_shapes, is_zero_centred_norm

# Qwen3.5 releases keep these in fp32 inside bf16 files.
KEEP_FP32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")
# Projections that write into the residual stream (see the module docstring on their gain).
RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight",
                    "mlp.experts.down_proj")


def tiny_target_weights(cfg: TargetConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic fp32 canonical weights for ``cfg`` (see the module docstring for the scales)."""
    gen = torch.Generator().manual_seed(seed)
    c = cfg.hidden_size
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_target_shapes(cfg).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            weights[name] = weights["embed_tokens.weight"]
            continue
        weights[name] = init_target_tensor(name, shape, gen, c)
    return weights


def _normal(shape, std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device) * std


def _uniform(shape, low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=torch.float32, device=gen.device)


def init_target_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, hidden: int) -> torch.Tensor:
    """One canonical target tensor, fp32 on the generator's device, scaled by its role (module docstring)."""
    if name.endswith("linear_attn.A_log"):
        return _uniform(shape, 1.0, 16.0, gen).log()
    if name.endswith("linear_attn.dt_bias"):
        dt = _uniform(shape, math.log(1e-3), math.log(1e-1), gen).exp()
        return dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + _normal(shape, 0.2, gen)
    if is_zero_centred_norm(name):
        return _normal(shape, 0.2, gen)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return _normal(shape, 3.0 / math.sqrt(hidden), gen)  # logits ~ N(0, 3^2) after the final norm
    if name.endswith("linear_attn.conv1d.weight"):
        return _normal(shape, 1.0 / math.sqrt(shape[-1]), gen)
    return _normal(shape, _gain(name) / math.sqrt(shape[-1]), gen)  # [out, in] and [E, out, in]: fan_in last


def _gain(name: str) -> float:
    if name.endswith(RESIDUAL_OUTPUTS):
        return 2.0
    if name.endswith("linear_attn.in_proj_a.weight"):
        return 0.5  # keeps the GDN decay near the one dt_bias sets
    return 1.0


def disk_tensors(cfg: TargetConfig, weights: dict[str, torch.Tensor], expert_format: str = "fused",
                 dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Canonical weights -> on-disk names and layout (the inverse of ``checkpoint.load_target``)."""
    store_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        keep_fp32 = name.endswith(KEEP_FP32_SUFFIXES)
        tensor = tensor.to(torch.float32 if keep_fp32 else store_dtype)
        if expert_format == "per_expert" and name.endswith("mlp.experts.gate_up_proj"):
            layer, i = name[: -len("mlp.experts.gate_up_proj")], cfg.moe_intermediate_size
            for j in range(cfg.num_experts):
                out[disk_tensor_name(cfg, f"{layer}mlp.experts.{j}.gate_proj.weight")] = tensor[j, :i].clone()
                out[disk_tensor_name(cfg, f"{layer}mlp.experts.{j}.up_proj.weight")] = tensor[j, i:].clone()
        elif expert_format == "per_expert" and name.endswith("mlp.experts.down_proj"):
            layer = name[: -len("mlp.experts.down_proj")]
            for j in range(cfg.num_experts):
                out[disk_tensor_name(cfg, f"{layer}mlp.experts.{j}.down_proj.weight")] = tensor[j].clone()
        else:
            out[disk_tensor_name(cfg, name)] = tensor.contiguous()
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """One ``model.safetensors``, or ``num_shards`` shards split by size in order plus the index."""
    if num_shards == 1:
        save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = list(tensors)
    if len(names) < num_shards:
        raise ValueError(f"num_shards={num_shards}: more shards than the {len(names)} tensors")
    sizes = [_nbytes(tensors[n]) for n in names]
    total = sum(sizes)
    starts = list(itertools.accumulate(sizes, initial=0))  # bytes before each tensor
    cuts = [0]
    for s in range(1, num_shards):  # shard s starts at the first tensor past s/num_shards of the bytes
        k = next((k for k in range(len(names)) if starts[k] * num_shards >= s * total), len(names))
        cuts.append(min(max(k, cuts[-1] + 1), len(names) - (num_shards - s)))
    cuts.append(len(names))
    shards = [names[cuts[s]:cuts[s + 1]] for s in range(num_shards)]
    weight_map: dict[str, str] = {}
    for s, shard_names in enumerate(shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in shard_names}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard_names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(path / INDEX_FILE, index)


def write_json(file: Path, obj: dict[str, Any]) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
