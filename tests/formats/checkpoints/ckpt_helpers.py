"""Edits that damage a checkpoint folder in one precise way (for the refusal tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file


def edit_tensors(file: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite one safetensors file after ``edit`` changes its name -> tensor dict in place."""
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_json(file: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))
