"""``ft make-tiny``: a tiny random checkpoint in real HF format (tests, demos), and optionally its DFlash 2 draft."""

from __future__ import annotations

import argparse


def add_make_tiny(sub: argparse._SubParsersAction) -> None:
    from dflash2.reference.tiny.target import PRESETS

    p = sub.add_parser("make-tiny", help="write a tiny random checkpoint in real HF format")
    p.add_argument("--out", required=True, help="folder to write (created)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny-dense")
    p.add_argument("--seed", type=int, default=None, help="weight seed (default: the preset's)")
    p.add_argument("--draft-out", default=None, help="also write a tiny random DFlash 2 draft for it here")
    p.set_defaults(func=run_make_tiny)


def run_make_tiny(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dflash2.reference.tiny.target import PRESETS, write_tiny_target

    spec = PRESETS[args.preset]
    if args.seed is not None:
        spec = replace(spec, seed=args.seed)
    path = write_tiny_target(args.out, spec)
    print(f"wrote {args.preset} to {path}")
    if args.draft_out:
        from dflash2.reference.tiny.draft import write_tiny_draft

        draft = write_tiny_draft(args.draft_out, path, seed=spec.seed)
        print(f"wrote a DFlash 2 draft for it to {draft}")
    return 0
