"""Golden GGUF files written by llama.cpp's own converter (``scripts/gguf_golden.sh``) and their sources.

The sources are the tiny checkpoints ``reference/tiny`` writes (a pure function of their presets and
seeds); ``golden/sources.json`` holds their fingerprints at the time the goldens were converted, so
a change to the factories fails here, with the command to rerun, rather than as a mismatch deep in
a tensor comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from dflash2.reference.formats.gguf_file import _field_value
from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.fingerprint import matches
from dflash2.reference.tiny.target import write_tiny_target

GOLDEN = Path(__file__).parent / "golden"
REGENERATE = "scripts/gguf_golden.sh"


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> Path:
    """tiny-dense, tiny-moe and the draft, as the golden script converted them."""
    root = tmp_path_factory.mktemp("gguf-sources")
    for preset in ("tiny-dense", "tiny-moe"):
        write_tiny_target(root / preset, preset, tokenizer="small")
    draft = write_tiny_draft(root / "draft", root / "tiny-dense")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}, indent=2) + "\n")
    recorded = json.loads((GOLDEN / "sources.json").read_text())["fingerprints"]
    for rel, want in recorded.items():
        if not matches(root / rel, want):
            pytest.fail(f"the tiny checkpoint file {rel} differs from the one the golden GGUF files were "
                        f"converted from; rerun {REGENERATE} and commit its output")
    return root


def rewrite(src: Path, dst: Path, *, arch: str | None = None, drop_keys=(), drop_tensors=(),
            requantize: dict | None = None, add_tensors: dict | None = None) -> Path:
    """Copy a GGUF file with gguf-py's writer, changing only what is asked: the architecture, keys or
    tensors dropped, tensors re-stored in another type (``{name: GGMLQuantizationType}``), float32
    tensors added (``{name: array in torch order}``)."""
    reader = GGUFReader(src)
    old_arch = _field_value(reader.fields["general.architecture"])
    writer = GGUFWriter(dst, arch or old_arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys:
            continue
        if arch is not None and name.startswith(old_arch + "."):
            name = arch + name[len(old_arch):]
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, _field_value(field), field.types[0], sub_type)
    for tensor in reader.tensors:
        if tensor.name in drop_tensors:
            continue
        qtype = (requantize or {}).get(tensor.name)
        if qtype is None:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        else:
            writer.add_tensor(tensor.name, quantize(np.asarray(tensor.data, dtype=np.float32), qtype), raw_dtype=qtype)
    for name, array in (add_tensors or {}).items():
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
