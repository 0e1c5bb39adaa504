"""Resumable stage state: model, optimizer, step, elapsed seconds, written atomically.

A stage saves ``<run>/<stage>/state.pt`` every ``save_every_s`` seconds and when its budget ends;
started again on the same run folder it loads that file and continues (same batches, same
schedule position). ``done.json`` marks a finished stage, so re-running the recipe skips it.
:class:`StageClock` is the loop's bookkeeping both training stages share.
"""

from __future__ import annotations

import json
import os
import time
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


class StageClock:
    """One stage's loop bookkeeping: the time budget, the learning rate, the log cadence, periodic saves.

    ``elapsed_s`` carries over a resume (it is part of :class:`Progress`), so the schedule and the
    budget continue where the interrupted run stopped. The first step, every ``log_every_s`` and the
    last step are logged (to ``log`` and ``<folder>/log.jsonl``); the state is saved every
    ``save_every_s`` and by :meth:`finish`.
    """

    def __init__(self, folder: Path, name: str, budget, progress: Progress, log, log_every_s: float,
                 save_every_s: float):
        self._now = time.perf_counter
        self.folder, self.name, self.budget, self.progress, self.log = folder, name, budget, progress, log
        self.log_every_s, self.save_every_s = log_every_s, save_every_s
        folder.mkdir(parents=True, exist_ok=True)
        self._started, self._elapsed_before = self._now(), progress.elapsed_s
        self._last_log = self._last_save = self._started

    def running(self) -> bool:
        return self.progress.elapsed_s < self.budget.seconds

    def set_learning_rate(self, optimizer: torch.optim.Optimizer) -> float:
        from .schedule import learning_rate

        b, p = self.budget, self.progress
        lr = learning_rate(b.lr, p.step, p.elapsed_s / b.seconds, b.warmup_steps, b.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step_done(self, tokens: int) -> bool:
        """Count a finished step; True when this step should be logged."""
        p, now = self.progress, self._now()
        p.step += 1
        p.tokens += tokens
        p.elapsed_s = self._elapsed_before + (now - self._started)
        due = p.step == 1 or now - self._last_log >= self.log_every_s or not self.running()
        if due:
            self._last_log = now
        return due

    def record(self, entry: dict) -> None:
        entry = {"step": self.progress.step, "elapsed_s": round(self.progress.elapsed_s, 1), **entry}
        self.log(f"{self.name}: " + json.dumps(entry))
        with (self.folder / "log.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def maybe_save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._now() - self._last_save >= self.save_every_s:
            save_state(self.folder, model, optimizer, self.progress)
            self._last_save = self._now()

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Save the final state; the summary fields every stage reports."""
        save_state(self.folder, model, optimizer, self.progress)
        p = self.progress
        return {"steps": p.step, "tokens": p.tokens, "train_seconds": round(p.elapsed_s, 1),
                "tokens_per_s": round(p.tokens / max(p.elapsed_s, 1e-9))}
