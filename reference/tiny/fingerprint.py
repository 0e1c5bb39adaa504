"""Fingerprints of the tiny checkpoints that golden files were made from.

Golden files (tests/formats/gguf/golden) are converted from checkpoints that ``reference/tiny`` writes
from presets and seeds. A test regenerates the checkpoints and checks them against the fingerprints
recorded beside the goldens, so a changed factory fails with the command to rerun rather than as a
mismatch deep in a tensor comparison. Bytes are too strict for the safetensors files: torch's
elementwise functions (``exp``, ``log``, ``expm1``) differ in their last bits between CPU
instruction sets (AVX2 and AVX-512 builds round differently), so the same factory writes other bytes
on another machine. A safetensors file is fingerprinted by each tensor's shape, sum and absolute sum
(float64) and matched to 1e-6 of the absolute sum; any other file by its sha256.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

RELATIVE_TOLERANCE = 1e-6


def fingerprint(path: Path) -> Any:
    """A file's sha256, or for a safetensors file ``{tensor: {"shape", "sum", "abs_sum"}}``."""
    path = Path(path)
    if path.suffix != ".safetensors":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    from safetensors.torch import load_file  # torch, not numpy: the drafts are bfloat16

    return {name: {"shape": list(tensor.shape), "sum": tensor.double().sum().item(),
                   "abs_sum": tensor.double().abs().sum().item()}
            for name, tensor in sorted(load_file(path).items())}


def matches(path: Path, recorded: Any) -> bool:
    """Whether ``path`` has the recorded fingerprint (sums within RELATIVE_TOLERANCE of the absolute sum)."""
    now = fingerprint(path)
    if isinstance(recorded, str) or isinstance(now, str):
        return now == recorded
    if sorted(now) != sorted(recorded):
        return False
    for name, got in now.items():
        want = recorded[name]
        bound = RELATIVE_TOLERANCE * want["abs_sum"]
        if (got["shape"] != want["shape"] or abs(got["sum"] - want["sum"]) > bound
                or abs(got["abs_sum"] - want["abs_sum"]) > bound):
            return False
    return True
