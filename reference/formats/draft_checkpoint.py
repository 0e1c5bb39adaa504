"""DFlash 2 draft checkpoint loading: the tensor table, validation by name and shape, and reading.

Shared by the reference and the fast engine. A draft stores exactly these tensors (facts sheet
section 1, as in z-lab/dflash's published ``dflash2-safetensors-header.json``), with no prefix,
no biases, no embedding and no LM head (the draft borrows the target's):

    fc.weight [C, m*C]                     hidden_norm.weight [C]          norm.weight [C]
    candidate_selector.hidden_projection.weight [r, C]
    candidate_selector.predecessor_codebook [V, r]    (no ``.weight`` suffix)
    candidate_selector.successor_codebook   [V, r]    (no ``.weight`` suffix)
    layers.{l}.input_layernorm.weight [C]            layers.{l}.post_attention_layernorm.weight [C]
    layers.{l}.self_attn.q_proj.weight [H*D, C]      layers.{l}.self_attn.{k,v}_proj.weight [Hkv*D, C]
    layers.{l}.self_attn.o_proj.weight [C, H*D]      layers.{l}.self_attn.{q,k}_norm.weight [D]
    layers.{l}.mlp.{gate,up}_proj.weight [I, C]      layers.{l}.mlp.down_proj.weight [C, I]
    layers.{l}.{attention,mlp}_conv.base_kernel [2, K, C]
    layers.{l}.{attention,mlp}_conv.kernel_projection.weight [2*K*C/G, C]

Every norm weight is a Qwen3 RMSNorm weight, applied as ``w * x`` (initialised to ones), unlike
the target's zero-centred ``(1 + w)``. Files: one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (read through ``checkpoint.list_checkpoint_tensors``). A
missing, misshaped, non-float or unexpected tensor is a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint import FLOAT_DTYPES, TensorInfo, list_checkpoint_tensors
from .config import TargetConfig
from .draft_config import DraftConfig, load_draft_config
from .errors import CheckpointError
from .gguf_file import GGUFModel, is_gguf_path
from .weights import Shape

BORROWED_FROM_TARGET = ("embed_tokens.weight", "lm_head.weight")


def expected_draft_shapes(cfg: DraftConfig) -> dict[str, Shape]:
    """Every tensor a draft with this config stores, with its shape."""
    c, v, r = cfg.hidden_size, cfg.vocab_size, cfg.selector_rank
    h, hkv, d, i = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    taps = cfg.conv_kernel_size
    shapes: dict[str, Shape] = {
        "fc.weight": (c, cfg.num_taps * c),
        "hidden_norm.weight": (c,),
        "norm.weight": (c,),
        "candidate_selector.hidden_projection.weight": (r, c),
        "candidate_selector.predecessor_codebook": (v, r),
        "candidate_selector.successor_codebook": (v, r),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes.update({
            f"{p}input_layernorm.weight": (c,),
            f"{p}post_attention_layernorm.weight": (c,),
            f"{p}self_attn.q_proj.weight": (h * d, c),
            f"{p}self_attn.k_proj.weight": (hkv * d, c),
            f"{p}self_attn.v_proj.weight": (hkv * d, c),
            f"{p}self_attn.o_proj.weight": (c, h * d),
            f"{p}self_attn.q_norm.weight": (d,),
            f"{p}self_attn.k_norm.weight": (d,),
            f"{p}mlp.gate_proj.weight": (i, c),
            f"{p}mlp.up_proj.weight": (i, c),
            f"{p}mlp.down_proj.weight": (c, i),
        })
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"{p}{conv}.base_kernel"] = (2, taps, c)
            shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * taps * cfg.num_conv_groups, c)
    return shapes


def _shape_error(name: str, info: TensorInfo, shape: Shape, cfg: DraftConfig) -> str:
    msg = f"tensor {name!r} has shape {list(info.shape)}, expected {list(shape)} from config.json"
    if name == "fc.weight" and len(info.shape) == 2 and info.shape[1] != shape[1]:
        msg += (f" (its in-features {info.shape[1]} must be m*hidden_size = {cfg.num_taps} target layers "
                f"{list(cfg.target_layer_ids)} x {cfg.hidden_size})")
    elif name.endswith("kernel_projection.weight"):
        msg += (f" (2 sides x conv_kernel_size={cfg.conv_kernel_size} x hidden_size/conv_group_size="
                f"{cfg.num_conv_groups} rows)")
    return msg


def check_draft_tensors(cfg: DraftConfig, stored: dict[str, TensorInfo]) -> None:
    """Validate names, shapes and dtypes of the stored tensors (no data read)."""
    expected = expected_draft_shapes(cfg)
    missing = [name for name in expected if name not in stored]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"missing tensor {', '.join(repr(n) for n in missing[:3])}{more} in the draft")
    for name, shape in expected.items():
        info = stored[name]
        if info.shape != tuple(shape):
            raise CheckpointError(_shape_error(name, info, shape, cfg))
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} is stored as {info.dtype}; expected one of {FLOAT_DTYPES} "
                                  "(quantized or packed draft weights are not supported)")
    borrowed = [n for n in stored if n.split(".", 1)[-1] in BORROWED_FROM_TARGET or n in BORROWED_FROM_TARGET]
    if borrowed:
        raise CheckpointError(f"unexpected tensor {borrowed[0]!r} in the draft: a DFlash 2 draft has no embedding "
                              "or LM head of its own (it borrows the target's)")
    extras = sorted(set(stored) - set(expected))
    if extras:
        more = f" (and {len(extras) - 3} more)" if len(extras) > 3 else ""
        raise CheckpointError(f"unexpected tensor {', '.join(repr(n) for n in extras[:3])}{more}: not part of a "
                              "DFlash 2 draft with this config.json (a layout this loader does not understand)")


def draft_config(path: str | Path | None, target_cfg: TargetConfig, k: int | None = None) -> DraftConfig:
    """The draft's validated config alone (fitted to ``target_cfg``): a folder's ``config.json``, or a ``.gguf``
    draft's metadata."""
    if path is not None and is_gguf_path(path):
        from .gguf_draft import gguf_draft_config  # here: gguf_draft reads this module's shapes

        return gguf_draft_config(GGUFModel(path), target_cfg, k)
    return load_draft_config(path, target_cfg, k)


def load_draft(path: str | Path | None, target_cfg: TargetConfig, k: int | None = None,
               dtype: torch.dtype = torch.float32) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """Read a draft folder: its validated config (fitted to ``target_cfg``) and every tensor in ``dtype``; or a
    ``.gguf`` draft (arch ``dflash``) through ``gguf_draft.load_gguf_draft``."""
    if path is not None and is_gguf_path(path):
        from .gguf_draft import load_gguf_draft  # here: gguf_draft reads this module's shapes

        return load_gguf_draft(path, target_cfg, k, dtype)
    cfg = load_draft_config(path, target_cfg, k)
    stored = list_checkpoint_tensors(path)
    check_draft_tensors(cfg, stored)
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name in expected_draft_shapes(cfg):
            file = stored[name].file
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            tensors[name] = handles[file].get_tensor(name).to(dtype)
    return cfg, tensors
