"""``ft``: the parser of every subcommand and the one place user errors become one line and exit status 2."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from dflash2.reference.formats.errors import UserInputError


def build_parser() -> argparse.ArgumentParser:
    from dflash2.bench.cli import add_bench
    from dflash2.train.cli import add_train

    from .generate import add_generate
    from .make_tiny import add_make_tiny
    from .serve import add_serve

    parser = argparse.ArgumentParser(prog="ft", description="dflash2: DFlash 2 speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_serve(sub)
    add_make_tiny(sub)
    add_bench(sub)
    add_train(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserInputError as exc:
        print(f"ft {args.command}: error: {exc}", file=sys.stderr)
        return 2
