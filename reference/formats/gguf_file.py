"""A GGUF file (or a split set of them) as one table of metadata and tensors, read with gguf-py.

The container, and nothing about any architecture: ``gguf_target.py`` and ``gguf_draft.py`` map
its names onto the canonical ones. Reading goes through the ``gguf`` package's ``GGUFReader``
(memory-mapped, so a tensor is read only when asked for) and its numpy dequantization
(``gguf.quants.dequantize``), the same code llama.cpp's own Python tools use.

Split sets, as llama.cpp's ``gguf-split`` and its converter write them: shards named
``<base>-00001-of-0000N.gguf`` .. ``-0000N-of-0000N.gguf``, each carrying ``split.no`` (0-based),
``split.count`` = N and ``split.tensors.count`` (the tensors of the whole set); the model's
metadata lives in the first shard. Pass the first shard's path; the others are found beside it.

Shapes: GGUF lists a tensor's dimensions fastest-first (ggml's ``ne``); :meth:`GGUFModel.shape`
and :meth:`GGUFModel.tensor` give them reversed, as torch orders them (``[rows, cols]``).
Refusals name the file, the key or tensor, and what was expected: a missing metadata key or
one of the wrong kind is a :class:`ConfigError`; a missing tensor, a weight type outside
:data:`SUPPORTED_TYPES` or a broken split set is a :class:`CheckpointError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor
from gguf.quants import dequantize

from .errors import CheckpointError, ConfigError

Q = GGMLQuantizationType
# Weight types issue 35 names, and the two that llama.cpp's IQ3_XXS mixture (not --pure) writes beside IQ3_XXS
# (IQ2_S for attn_q/attn_k, IQ3_S for token_embd/attn_output): a hub IQ3_XXS file holds all three. Each dequantizes
# through gguf-py's numpy code.
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_S)
SPLIT_NAME = re.compile(r"^(?P<base>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def is_gguf_path(path: str | Path) -> bool:
    """Whether a model path names a GGUF file (rather than an HF checkpoint folder)."""
    return Path(path).suffix == ".gguf"


@dataclass(frozen=True)
class _Located:
    file: Path
    tensor: ReaderTensor


class GGUFModel:
    """Metadata (first shard's) and tensors (of every shard) of one GGUF model."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = split_files(self.path)
        readers = [_open(f) for f in self.files]
        self.metadata: dict[str, Any] = {name: _field_value(field) for name, field in readers[0].fields.items()
                                         if not name.startswith("GGUF.")}
        self._tensors: dict[str, _Located] = {}
        for file, reader in zip(self.files, readers):
            for tensor in reader.tensors:
                if tensor.name in self._tensors:
                    raise CheckpointError(f"{file}: tensor {tensor.name!r} is also in "
                                          f"{self._tensors[tensor.name].file}; expected each tensor in one shard")
                self._tensors[tensor.name] = _Located(file, tensor)
        if len(self.files) > 1:
            _check_split(self.files, readers, len(self._tensors))

    @property
    def arch(self) -> str:
        return self.get("general.architecture", str)

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        """Metadata ``key`` as ``kind`` (``int``, ``float``, ``str``, ``bool``, ``list``); ``default`` if absent."""
        if key not in self.metadata:
            if default is not ...:
                return default
            raise ConfigError(f"{self.path}: metadata key {key!r} is missing; expected {_kind_name(kind)}")
        value = self.metadata[key]
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float, (int, float)))
        if not ok:
            raise ConfigError(f"{self.path}: metadata {key}={_short(value)}: expected {_kind_name(kind)}")
        return value

    def names(self) -> list[str]:
        return list(self._tensors)

    def type_of(self, name: str) -> GGMLQuantizationType:
        return self._locate(name).tensor.tensor_type

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in torch order (GGUF's dimension list reversed)."""
        return tuple(int(n) for n in reversed(self._locate(name).tensor.shape))

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor, dequantized by gguf-py to float32, then cast to ``dtype``; shape in torch order."""
        data, qtype = self.stored(name)
        values = dequantize(data, qtype).astype(np.float32, copy=False)
        return torch.from_numpy(values.reshape(self.shape(name)).copy()).to(dtype)

    def stored(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
        """The tensor's bytes as the file holds them (a read-only memory map: uint8 rows of blocks for a quantized
        type, the values for F32/F16) and its type; a type outside :data:`SUPPORTED_TYPES` is refused."""
        located = self._locate(name)
        qtype = located.tensor.tensor_type
        if qtype not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{located.file}: tensor {name!r} is stored as {qtype.name}; expected one of "
                f"{', '.join(t.name for t in SUPPORTED_TYPES)}")
        return np.asarray(located.tensor.data), qtype

    def _locate(self, name: str) -> _Located:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        return self._tensors[name]


def split_files(path: Path) -> tuple[Path, ...]:
    """The shard files of ``path``: itself, or every shard of the split set whose first shard it is."""
    if not path.is_file():
        raise CheckpointError(f"model path {str(path)!r}: no such GGUF file")
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return (path,)
    no, count = int(match["no"]), int(match["count"])
    if no != 1:
        first = path.with_name(f"{match['base']}-00001-of-{match['count']}.gguf")
        raise CheckpointError(f"{path}: shard {no} of a split GGUF; expected the first shard's path ({first.name})")
    files = tuple(path.with_name(f"{match['base']}-{i:05d}-of-{match['count']}.gguf") for i in range(1, count + 1))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF of {count} shards, but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}")
    return files


def _check_split(files: tuple[Path, ...], readers: list[GGUFReader], num_tensors: int) -> None:
    for i, (file, reader) in enumerate(zip(files, readers)):
        got = {key: _field_value(reader.fields[key]) if key in reader.fields else None for key in SPLIT_KEYS}
        if got["split.no"] != i or got["split.count"] != len(files):
            raise CheckpointError(f"{file}: split.no={got['split.no']!r}, split.count={got['split.count']!r}; "
                                  f"expected {i} and {len(files)} from its name")
        if got["split.tensors.count"] != num_tensors:
            raise CheckpointError(f"{file}: split.tensors.count={got['split.tensors.count']!r}, but the "
                                  f"{len(files)} shards hold {num_tensors} tensors")


def _open(file: Path) -> GGUFReader:
    try:
        return GGUFReader(file)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable GGUF file ({exc})") from None


def _field_value(field: ReaderField) -> Any:
    """A field's value as Python: scalars, str, or a list (arrays of strings included)."""
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v.item() if isinstance(v, np.generic) else v for v in field.contents()]
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# a full-attention block's tensors, the same in a target's layer and a DFlash draft's (GGUF name -> canonical name
# inside ``layers.{i}.``)
ATTENTION_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def f32_metadata(value: float) -> float:
    """A float32 metadata value as the decimal its writer meant (1e-06, not 9.999999974752427e-07):
    the shortest decimal that rounds to the same float32."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def same_ggml_shape(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Whether two shapes (torch order) are one ggml shape: ggml pads ``ne`` with 1s, and llama.cpp's quantizer
    writes a tensor without its trailing ones (a Qwen3.5-MoE ``ffn_gate_inp_shexp`` of [1, C] comes out as [C])."""
    def strip(s: tuple[int, ...]) -> tuple[int, ...]:
        s = tuple(s)
        return s[next((i for i, n in enumerate(s) if n != 1), len(s)):]
    return strip(shape) == strip(expected)
