"""Resumable stage state: model, optimizer, step, elapsed seconds, written atomically.

A stage saves ``<run>/<stage>/state.pt`` every ``save_every_s`` seconds and when its budget ends;
started again on the same run folder it loads that file and continues (same batches, same
schedule position). ``done.json`` marks a finished stage, so re-running the recipe skips it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Progress:
    step: int = 0
    elapsed_s: float = 0.0
    tokens: int = 0


def save_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: Progress) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "state.pt.tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "progress": vars(progress)}, tmp)
    os.replace(tmp, folder / "state.pt")  # a cut mid-write leaves the previous state whole


def load_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Progress | None:
    path = folder / "state.pt"
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return Progress(**saved["progress"])


def mark_done(folder: Path, summary: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "done.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def done_summary(folder: Path) -> dict | None:
    path = folder / "done.json"
    return json.loads(path.read_text()) if path.exists() else None
