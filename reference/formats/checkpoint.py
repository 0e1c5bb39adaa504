"""Target checkpoint loading: HF safetensors on disk -> canonical tensors (see ``weights.py``).

Shared by the reference and the fast engine, so both accept and refuse exactly the same files.

Layouts accepted (all as Qwen3.5-family releases and transformers write them):

- files: one ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
  (``weight_map``: tensor name -> shard file);
- prefix: the text model under ``model.`` (``*_text`` model types) or ``model.language_model.``
  (the multimodal wrapper, whose ``model.visual.*`` vision tower is skipped);
- ``lm_head.weight`` at the top level, or absent when ``tie_word_embeddings`` (then it is the
  embedding); the MTP head at the top level under ``mtp.`` (no model prefix);
- MoE experts fused (``mlp.experts.gate_up_proj [E, 2I, C]`` gate rows first,
  ``mlp.experts.down_proj [E, C, I]``) or one tensor per expert
  (``mlp.experts.{j}.{gate,up,down}_proj.weight``), in the trunk and in ``mtp.layers.0``.

Everything else is refused with a :class:`CheckpointError` naming the tensor (on disk and
canonical), the shapes, or the file: a tensor we do not expect means a format we do not
understand, so it is an error rather than something to skip. Floating tensors (fp32, bf16,
fp16) are converted to the requested dtype; anything else (packed integers, fp8) is refused.
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import TargetConfig, load_target_config
from .errors import CheckpointError
from .gguf_file import GGUFModel, is_gguf_path
from .gguf_target import gguf_target_config, load_gguf_target
from .weights import Shape, expected_target_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
VISION_PREFIX = "model.visual."
FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored: its shard file, shape and safetensors dtype string (``BF16``...)."""

    file: Path
    shape: Shape
    dtype: str


@dataclass(frozen=True)
class _Recipe:
    """How one canonical tensor is built from on-disk tensors.

    ``copy``: ``sources[0]`` as is. ``gate_up``: per expert j, ``cat(gate_j, up_j)`` on rows, then
    stacked over experts (sources: E gates then E ups). ``stack``: the E sources stacked.
    ``tied_copy``: a shipped ``lm_head.weight`` under tied embeddings, which must equal the embedding.
    """

    kind: str
    sources: tuple[str, ...]


def list_checkpoint_tensors(model_path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor stored in the checkpoint folder, by on-disk name (no data is read).

    Uses ``model.safetensors`` if present (as transformers does), else the shard index.
    """
    path = Path(model_path)
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a checkpoint folder")
    single = path / SINGLE_FILE
    if single.is_file():
        return _scan_file(single)
    index_file = path / INDEX_FILE
    if not index_file.is_file():
        present = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
        raise CheckpointError(
            f"{path}: no {SINGLE_FILE} and no {INDEX_FILE} (weight files present: {present or 'none'}); "
            "expected HF safetensors")
    return _scan_index(path, index_file)


def _scan_file(file: Path) -> dict[str, TensorInfo]:
    try:
        with safe_open(file, framework="pt") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}
            return {name: TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype()) for name, sl in slices.items()}
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


def _scan_index(path: Path, index_file: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index_file}: expected JSON with a 'weight_map' object ({exc!r})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: 'weight_map' must be a non-empty object of tensor name -> shard file")
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index_file}: weight_map[{name!r}]={shard!r}: expected a shard file name")
        by_shard[shard].append(name)
    tensors: dict[str, TensorInfo] = {}
    for shard, names in sorted(by_shard.items()):
        shard_file = path / shard
        if not shard_file.is_file():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise CheckpointError(
                f"{INDEX_FILE} references shard {shard!r} (holding {names[0]!r}{more}), "
                f"which is missing from {path}")
        stored = _scan_file(shard_file)
        for name in names:
            if name not in stored:
                raise CheckpointError(f"{INDEX_FILE} places {name!r} in {shard!r}, but that shard does not hold it")
            tensors[name] = stored[name]
    return tensors


def target_config(model_path: str | Path) -> TargetConfig:
    """The target's validated config alone: a folder's ``config.json``, or a ``.gguf`` file's metadata."""
    if is_gguf_path(model_path):
        return gguf_target_config(GGUFModel(model_path))
    return load_target_config(model_path)


def load_target(model_path: str | Path,
                dtype: torch.dtype | None = torch.float32) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    """Read a target checkpoint folder: its validated config and every canonical tensor in ``dtype``.

    ``dtype=None`` keeps each tensor as stored (an engine casts per tensor itself; a bf16
    checkpoint then takes half the host memory of an fp32 copy).

    Tied embeddings give ``lm_head.weight`` and ``embed_tokens.weight`` the same tensor object. A ``.gguf`` path
    (a file, or the first shard of a split set) is read by ``gguf_target.load_gguf_target`` (dequantized, in
    ``dtype``; fp32 when None).
    """
    if is_gguf_path(model_path):
        return load_gguf_target(model_path, torch.float32 if dtype is None else dtype)
    cfg = load_target_config(model_path)
    stored = list_checkpoint_tensors(model_path)
    recipes = plan_target_tensors(cfg, stored)
    tensors = _materialize(recipes, stored, dtype)
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return cfg, tensors


def plan_target_tensors(cfg: TargetConfig, stored: dict[str, TensorInfo]) -> dict[str, _Recipe]:
    """Map on-disk names onto canonical ones and validate names, shapes and dtypes (no data read).

    Returns a recipe per canonical tensor (a tied ``lm_head.weight`` only if the file ships one).
    """
    expected = expected_target_shapes(cfg)
    by_canonical: dict[str, str] = {}  # canonical name (per-expert names included) -> disk name
    outside: list[str] = []  # names in no place a text-model tensor may live
    for disk_name in stored:
        canonical = _canonical_name(cfg, disk_name)
        if canonical == "":
            outside.append(disk_name)
        elif canonical is not None:
            by_canonical[canonical] = disk_name

    recipes: dict[str, _Recipe] = {}
    missing: list[str] = []
    for canonical, shape in expected.items():
        if canonical == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if canonical in by_canonical:
            disk_name = by_canonical.pop(canonical)
            _check_tensor(disk_name, canonical, stored[disk_name], shape)
            recipes[canonical] = _Recipe("copy", (disk_name,))
        elif canonical.endswith(_FUSED_EXPERTS) and _has_per_expert(canonical, by_canonical):
            recipes[canonical] = _per_expert_recipe(cfg, canonical, by_canonical, stored)
        else:
            missing.append(_describe_missing(cfg, canonical))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"missing tensor {', '.join(missing[:3])}{more}{_prefix_hint(cfg, stored)}")

    if cfg.tie_word_embeddings and "lm_head.weight" in by_canonical:
        # A tied checkpoint may still ship the head; it must equal the embedding (checked on load).
        disk_name = by_canonical.pop("lm_head.weight")
        _check_tensor(disk_name, "lm_head.weight", stored[disk_name], expected["lm_head.weight"])
        recipes["lm_head.weight"] = _Recipe("tied_copy", (disk_name,))
    extras = sorted(outside + list(by_canonical.values()))
    if extras:
        more = f" (and {len(extras) - 3} more)" if len(extras) > 3 else ""
        raise CheckpointError(
            f"unexpected tensor {', '.join(repr(n) for n in extras[:3])}{more}: not part of a "
            f"{cfg.model_type!r} text model with this config.json (a layout this loader does not understand)")
    return recipes


_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _canonical_name(cfg: TargetConfig, disk_name: str) -> str | None:
    """The canonical name of an on-disk tensor; None if deliberately skipped, "" if it lives nowhere known.

    Skipped: the vision tower of the multimodal wrapper, and ``mtp.*`` when the config has no MTP
    layer (transformers ignores both the same way).
    """
    if disk_name.startswith("mtp."):
        return disk_name if cfg.mtp_num_hidden_layers else None
    if disk_name == "lm_head.weight":
        return disk_name
    if cfg.weight_prefix == "model.language_model." and disk_name.startswith(VISION_PREFIX):
        return None
    if disk_name.startswith(cfg.weight_prefix):
        return disk_name[len(cfg.weight_prefix):]
    return ""


def disk_tensor_name(cfg: TargetConfig, canonical: str) -> str:
    """Where a canonical tensor lives on disk: ``lm_head.*`` and ``mtp.*`` at the top level."""
    if canonical.startswith(("lm_head.", "mtp.")):
        return canonical
    return cfg.weight_prefix + canonical


def _describe_missing(cfg: TargetConfig, canonical: str) -> str:
    text = f"{disk_tensor_name(cfg, canonical)!r} (canonical {canonical!r}"
    if canonical.endswith(_FUSED_EXPERTS):
        layer, projs = _split_fused(canonical)
        per_expert = disk_tensor_name(cfg, f"{layer}mlp.experts.{{j}}.{projs[0]}_proj.weight")
        text += f", or one per expert: {per_expert!r}"
    if canonical == "lm_head.weight":
        text += ", needed since tie_word_embeddings is false"
    return text + ")"


def _split_fused(canonical: str) -> tuple[str, tuple[str, ...]]:
    """``layers.3.mlp.experts.gate_up_proj`` -> (``layers.3.``, ("gate", "up"))."""
    if canonical.endswith("gate_up_proj"):
        return canonical[: -len("mlp.experts.gate_up_proj")], ("gate", "up")
    return canonical[: -len("mlp.experts.down_proj")], ("down",)


def _has_per_expert(canonical: str, by_canonical: dict[str, str]) -> bool:
    layer, projs = _split_fused(canonical)
    return any(n.startswith(f"{layer}mlp.experts.") and n.endswith(f".{projs[0]}_proj.weight") for n in by_canonical)


def _per_expert_recipe(cfg: TargetConfig, canonical: str, by_canonical: dict[str, str],
                       stored: dict[str, TensorInfo]) -> _Recipe:
    """A fused expert tensor from per-expert ``mlp.experts.{j}.{gate,up,down}_proj.weight`` tensors."""
    layer, projs = _split_fused(canonical)
    c, i = cfg.hidden_size, cfg.moe_intermediate_size
    sources: list[str] = []
    for proj in projs:
        for j in range(cfg.num_experts):
            name = f"{layer}mlp.experts.{j}.{proj}_proj.weight"
            if name not in by_canonical:
                raise CheckpointError(
                    f"missing tensor {disk_tensor_name(cfg, name)!r} (expert {j} of {cfg.num_experts} for canonical "
                    f"{canonical!r}; the checkpoint stores experts one tensor per expert)")
            disk_name = by_canonical.pop(name)
            _check_tensor(disk_name, canonical, stored[disk_name], (c, i) if proj == "down" else (i, c))
            sources.append(disk_name)
    return _Recipe("gate_up" if len(projs) == 2 else "stack", tuple(sources))


def _check_tensor(disk_name: str, canonical: str, info: TensorInfo, shape: Shape) -> None:
    if info.shape != tuple(shape):
        raise CheckpointError(
            f"tensor {disk_name!r} (canonical {canonical!r}) has shape {list(info.shape)}, "
            f"expected {list(shape)} from config.json")
    if info.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"tensor {disk_name!r} (canonical {canonical!r}) is stored as {info.dtype}; expected one of "
            f"{FLOAT_DTYPES} (quantized or packed weights are not supported)")


def _prefix_hint(cfg: TargetConfig, stored: dict[str, TensorInfo]) -> str:
    other = "model." if cfg.weight_prefix == "model.language_model." else "model.language_model."
    if other == "model." and any(n.startswith("model.") and not n.startswith("model.language_model.")
                                 and not n.startswith(VISION_PREFIX) for n in stored):
        return f"; the text model's tensors are under 'model.', which model_type {cfg.model_type!r} does not use"
    if other == "model.language_model." and any(n.startswith(other) for n in stored):
        return (f"; the tensors are under 'model.language_model.', the multimodal wrapper's prefix, but "
                f"model_type {cfg.model_type!r} is the text-only layout (tensors under 'model.')")
    return ""


def _materialize(recipes: dict[str, _Recipe], stored: dict[str, TensorInfo],
                 dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Read the tensors the recipes name, one open handle per shard, converted to ``dtype`` (None: as stored)."""
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(disk_name: str) -> torch.Tensor:
            file = stored[disk_name].file
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            tensor = handles[file].get_tensor(disk_name)
            return tensor if dtype is None else tensor.to(dtype)

        tensors: dict[str, torch.Tensor] = {}
        for canonical, recipe in recipes.items():
            if recipe.kind == "copy":
                tensors[canonical] = read(recipe.sources[0])
            elif recipe.kind == "gate_up":  # sources: E gates, then E ups
                half = len(recipe.sources) // 2
                gates, ups = recipe.sources[:half], recipe.sources[half:]
                tensors[canonical] = torch.stack([torch.cat([read(g), read(u)], dim=0) for g, u in zip(gates, ups)])
            elif recipe.kind == "stack":
                tensors[canonical] = torch.stack([read(name) for name in recipe.sources])
            elif recipe.kind == "tied_copy":
                head = read(recipe.sources[0])
                if not torch.equal(head, tensors["embed_tokens.weight"]):
                    raise CheckpointError(
                        f"tensor {recipe.sources[0]!r} differs from the embedding, but config.json says "
                        "tie_word_embeddings=true; expected no lm_head.weight or a copy of the embedding")
            else:
                raise AssertionError(recipe.kind)
        return tensors
