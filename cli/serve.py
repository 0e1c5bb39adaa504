"""``ft serve``: the engine and speculative flags of ``ft generate``, the server's (``ServeSettings``), then
``fast/serve/server.run_serve``. With no ``--model`` it serves the bundled pair, with its DFlash draft unless
``--speculative-algorithm`` says otherwise (and says so in its startup log)."""

from __future__ import annotations

import argparse
import logging

from dflash2.fast.engine.config import add_engine_args, engine_config_from_args

from .generate import add_speculative_args

logger = logging.getLogger("dflash2.fast.serve")


def add_serve(sub: argparse._SubParsersAction) -> None:
    from dflash2.fast.serve.settings import add_serve_args  # argparse only: fastapi and uvicorn load when serving

    p = sub.add_parser("serve", help="serve the OpenAI API (chat and text completions) on the fast engine")
    p.add_argument("--model", default=None,
                   help="target checkpoint folder (HF format) or .gguf file (default: the bundled trained pair, "
                        "models/, served with its DFlash 2 draft)")
    add_speculative_args(p)
    p.set_defaults(speculative_algorithm=None)  # None: the bundled pair's default (dflash), else none
    engine = p.add_argument_group("fast engine (EngineConfig)")
    add_engine_args(engine)
    engine.add_argument("--max-running-requests", dest="max_running_req", type=int, default=argparse.SUPPRESS,
                        help="the same as --max-running-req")
    add_serve_args(p.add_argument_group("server"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash2.fast.serve.server import run_serve
    from dflash2.fast.serve.settings import serve_settings_from_args

    settings = serve_settings_from_args(args)  # first: a bad flag is refused before the model loads
    bundled_default = args.model is None and args.speculative_algorithm is None
    if args.speculative_algorithm is None:
        args.speculative_algorithm = "dflash" if args.model is None else "none"
    config = engine_config_from_args(args)
    if bundled_default:
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        logger.info("no --model: serving the bundled pair %s with its DFlash 2 draft %s "
                    "(--speculative-algorithm none for plain decoding)", config.model_path,
                    config.speculative_draft_model_path)
    return run_serve(config, settings, model_given=args.model)
