"""The bundled default model pair: a small Qwen3.5 target and its DFlash 2 draft, trained here.

``models/<DEFAULT_NAME>/target`` is a real Qwen3.5 checkpoint folder (config, bf16 safetensors,
tokenizer with its chat template, an MTP head); ``.../draft`` a DFlash 2 draft for it;
``MODEL_CARD.md`` says what data, steps and figures made them (``ft train``, docs/training.md).
``ft generate``, ``ft serve`` and ``LLM()`` load this pair when no model path is given, and its
draft when ``dflash`` is asked for without a draft path.
"""

from __future__ import annotations

from pathlib import Path

from dflash2.reference.formats.errors import UserInputError

DEFAULT_NAME = "pycoder-10m"
ROOT = Path(__file__).resolve().parent


def bundled_target() -> Path:
    return ROOT / DEFAULT_NAME / "target"


def bundled_draft() -> Path:
    return ROOT / DEFAULT_NAME / "draft"


def pair_folders(folder: Path) -> tuple[Path, Path] | None:
    """``(folder/target, folder/draft)`` when ``folder`` is a pair folder (a target and its DFlash 2 draft side by
    side, as the bundled pair and ``ft train`` lay them out) rather than a checkpoint folder; else None."""
    folder = Path(folder)
    if (folder / "config.json").exists() or not (folder / "target" / "config.json").exists():
        return None
    return folder / "target", folder / "draft"


def resolve_model_paths(model_path: str | Path | None, algorithm: str | None,
                        draft_path: str | Path | None) -> tuple[str, str | None]:
    """(target, draft) with the bundled pair filling what was not given.

    No model path: the bundled target, and with ``dflash`` and no draft path its bundled draft. A pair folder
    (``target/`` and ``draft/`` inside, e.g. ``models/pycoder-10m``) is taken the same way. A draft for a model
    the user named is never guessed: the engine's own error then asks for it.
    """
    if model_path is None:
        target = bundled_target()
        if not (target / "config.json").exists():
            raise UserInputError(f"model: none given and the bundled default is missing at {target}; "
                                 "pass --model PATH (or reinstall dflash2)")
        model_path = target.parent
    pair = pair_folders(Path(model_path))
    if pair is None:
        return str(model_path), None if draft_path is None else str(draft_path)
    target, draft = pair
    if algorithm == "dflash" and draft_path is None and (draft / "config.json").exists():
        draft_path = draft
    return str(target), None if draft_path is None else str(draft_path)
