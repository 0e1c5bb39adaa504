"""``ft train <stage>``: the training recipe's command line.

    ft train corpus    --corpus .corpus                     # CPU: gather, split by file, compress
    ft train tokenizer --corpus .corpus --run runs/train    # CPU: byte-level BPE on the train split
    ft train target    --corpus .corpus --run runs/train    # GPU, <= 10 min: target + MTP head
    ft train draft     --corpus .corpus --run runs/train    # GPU, <= 10 min: DFlash 2 draft + MTP fine-tune
    ft train refine    --corpus .corpus --run runs/train    # GPU: both again, on text the target generated
    ft train evaluate  --corpus .corpus --run runs/train    # tokens/step and tokens/s of every setting
    ft train export    --run runs/train --out models/...    # copy the final pair into a model folder
    ft train all       ...                                  # every stage not yet done, in order

Every stage reads ``<run>/recipe.json`` (written on first use from the defaults, or from
``--smoke``, a seconds-long CPU recipe the test suite runs), resumes from its own state file and
skips itself once ``done.json`` says it finished.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dflash2.reference.formats.errors import UserInputError

STAGES = ("corpus", "tokenizer", "target", "draft", "refine", "evaluate", "export", "all")


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="the training recipe: corpus, tokenizer, target, draft, evaluate, export")
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--corpus", default=".corpus", help="corpus folder (written by the corpus stage)")
    p.add_argument("--run", default="runs/train", help="run folder: recipe, tokenizer, stage states and models")
    p.add_argument("--out", default=None, help="export: the folder that receives target/ and draft/")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--smoke", action="store_true", help="a seconds-long CPU recipe (tests); only for a new run")
    p.add_argument("--seconds", type=float, default=None, help="override the stage's training budget")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forwards")
    p.add_argument("--eval-prompts", type=int, default=4, help="evaluate: held-out prompts per kind (code, docs)")
    p.add_argument("--eval-max-tokens", type=int, default=128)
    p.add_argument("--eval-settings", default=None,
                   help="evaluate: comma-separated subset of off,mtp3,mtp7,dflash3,dflash7 (default: all)")
    p.add_argument("--eval-modes", default=None, help="evaluate: greedy, t1 or both (default: greedy,t1)")
    p.add_argument("--report", default=None, help="evaluate: write report.json and report.md into this folder")
    p.add_argument("--max-mb", type=float, default=None, help="corpus: raw text cap in MB")
    p.add_argument("--pair", default=None,
                   help="refine: start from this pair instead of the run's draft stage; evaluate: judge this pair "
                        "instead of the run's last stage (a stage folder with model/ and target/, or an exported "
                        "one with draft/ and target/, e.g. models/pycoder-10m)")
    p.set_defaults(func=run_train)


def _recipe(args):
    from dataclasses import replace

    from .recipe import Recipe, load_recipe, save_recipe, smoke_recipe

    run = Path(args.run)
    if (run / "recipe.json").exists():
        recipe = load_recipe(run)
    else:
        recipe = smoke_recipe() if args.smoke else Recipe()
        save_recipe(run, recipe)
    if args.compile:
        recipe = replace(recipe, compile=True)
    if args.seconds is not None:
        recipe = replace(recipe, target_stage=replace(recipe.target_stage, seconds=args.seconds),
                         draft_stage=replace(recipe.draft_stage, seconds=args.seconds),
                         refine_stage=replace(recipe.refine_stage, seconds=args.seconds))
    return recipe


def _device(args):
    import torch

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return torch.device(name)


def run_train(args: argparse.Namespace) -> int:
    stages = ["corpus", "tokenizer", "target", "draft", "refine", "evaluate"] if args.stage == "all" else [args.stage]
    for stage in stages:
        _run_stage(stage, args)
    return 0


def final_stage(run: Path) -> Path:
    """The last finished draft stage's folder: ``refine`` when it ran, else ``draft``."""
    for stage in ("refine", "draft"):
        if (run / stage / "done.json").exists():
            return run / stage
    raise UserInputError(f"run {str(run)!r}: no finished draft stage (run `ft train draft` first)")


def pair_folders(folder: Path) -> tuple[Path, Path]:
    """``(target_dir, draft_dir)`` of a pair: a stage folder (``model/``, ``target/``) or an export (``draft/``)."""
    folder = Path(folder)
    for draft_name in ("model", "draft"):
        if (folder / draft_name / "config.json").exists() and (folder / "target" / "config.json").exists():
            return folder / "target", folder / draft_name
    raise UserInputError(f"pair {str(folder)!r}: expected target/config.json beside model/config.json (a stage "
                         f"folder) or draft/config.json (an exported pair)")


def _pair(args, run: Path) -> tuple[Path, Path]:
    return pair_folders(Path(args.pair) if args.pair else final_stage(run))


def _need(path: Path, stage: str, before: str) -> None:
    if not path.exists():
        raise UserInputError(f"ft train {stage}: {path} is missing; run `ft train {before}` first")


def _log(line: str) -> None:
    print(line, flush=True)


def _run_stage(stage: str, args: argparse.Namespace) -> None:
    corpus, run = Path(args.corpus), Path(args.run)
    if stage == "corpus":
        from .corpus import build_corpus

        if (corpus / "manifest.json").exists():
            _log(f"corpus: {corpus} exists; delete it to rebuild")
            return
        kwargs = {} if args.max_mb is None else {"max_bytes": int(args.max_mb * 2**20)}
        recipe = _recipe(args)
        build_corpus(corpus, heldout_percent=recipe.heldout_percent, **kwargs)
        _log(f"corpus: written to {corpus}")
        return
    recipe = _recipe(args)
    tokenizer_dir = run / "tokenizer"
    if stage == "tokenizer":
        from .tokenizer import train_tokenizer

        if (tokenizer_dir / "tokenizer.json").exists():
            _log(f"tokenizer: {tokenizer_dir} exists")
            return
        info = train_tokenizer(corpus, tokenizer_dir, vocab_size=recipe.vocab_size)
        _log(f"tokenizer: {info.vocab_size} ids written to {tokenizer_dir}")
        return
    if stage in ("target", "draft", "refine"):
        from .data import load_or_tokenize
        from .export import tokenizer_ids

        _need(tokenizer_dir / "tokenizer.json", stage, "tokenizer")
        ids = tokenizer_ids(tokenizer_dir)

        device = _device(args)
        train = load_or_tokenize(run, corpus, tokenizer_dir, "train")
        if stage == "target":
            from .target_stage import train_target

            heldout = load_or_tokenize(run, corpus, tokenizer_dir, "heldout")
            train_target(run, recipe, ids, tokenizer_dir, train, heldout, device, log=_log)
        elif stage == "draft":
            from .draft_stage import train_draft

            train_draft(run, recipe, ids, tokenizer_dir, train, device, log=_log)
        else:
            from .draft_stage import train_draft
            from .generate_data import load_or_generate

            if args.pair is None:
                _need(run / "draft" / "done.json", "refine", "draft")
            start = pair_folders(Path(args.pair) if args.pair else run / "draft")
            rows = load_or_generate(run, start[0], train, recipe, device.type, log=_log)
            train_draft(run, recipe, ids, tokenizer_dir, rows, device, log=_log, stage="refine",
                        init_from=start, budget=recipe.refine_stage,
                        min_anchor=recipe.generate_prompt_len - 1)
        return
    if stage == "evaluate":
        from .evaluate import SAMPLING, SETTINGS, evaluate_pair, markdown_table

        names = [s[0] for s in SETTINGS]
        wanted = names if args.eval_settings is None else args.eval_settings.split(",")
        modes = list(SAMPLING) if args.eval_modes is None else args.eval_modes.split(",")
        for value, allowed, flag in ((wanted, names, "eval_settings"), (modes, list(SAMPLING), "eval_modes")):
            if not value or set(value) - set(allowed):
                raise UserInputError(f"{flag}={','.join(value)!r}: expected a comma-separated subset of "
                                     f"{','.join(allowed)}")
        target_dir, draft_dir = _pair(args, run)
        report = evaluate_pair(target_dir, draft_dir, corpus,
                               device=args.device, per_source=args.eval_prompts,
                               max_tokens=args.eval_max_tokens, settings=[s for s in SETTINGS if s[0] in wanted],
                               sampling_modes=modes, log=_log)
        out = Path(args.report) if args.report else run
        out.mkdir(parents=True, exist_ok=True)
        report["pair"] = str(draft_dir.parent)
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "report.md").write_text(markdown_table(report) + "\n")
        _log(markdown_table(report))
        return
    if stage == "export":
        if args.out is None:
            raise UserInputError("out: expected --out FOLDER (it receives target/ and draft/)")
        out = Path(args.out)
        final = final_stage(run)
        for name, src in (("target", final / "target"), ("draft", final / "model")):
            if not (src / "config.json").exists():
                raise UserInputError(f"{src}: no model folder; run `ft train draft` first")
            shutil.rmtree(out / name, ignore_errors=True)
            shutil.copytree(src, out / name)
        _log(f"export: {out}/target and {out}/draft")
