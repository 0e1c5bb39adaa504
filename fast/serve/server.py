"""``ft serve``: load the engine, log one summary, serve until SIGTERM or Ctrl-C, drain, exit.

Startup: bind the socket (a port in use is a user error, found before the model loads), then, behind
a progress bar on stderr, load the checkpoint and allocate the caches (every refusal of ``ft
generate`` happens here, with its one-line error and exit status 2) and warm up
(``fast/engine/warmup.py``: two waves of requests that compile the kernels and capture the graphs of
every batch bucket, so the first clients do not pay for them).
Then one log line: model, algorithm, k, KV tokens, draft memory, device, dtype, slots.

Shutdown: uvicorn's graceful shutdown stops accepting connections and waits up to
``--drain-timeout`` seconds for the open ones, whose requests the engine thread keeps stepping to
their end; then the engine thread stops (aborting anything a timed-out connection left) and the
process exits 0. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from pathlib import Path

from dflash2.reference.formats.errors import UserInputError

logger = logging.getLogger("dflash2.fast.serve")
DEFAULT_PORT = 8000
MiB = 1 << 20


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The serving flags (the engine flags are added by the caller, as for ``ft generate``)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: --model as given)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 request")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting beyond --max-running-requests before new ones get a 429 (default: "
                        "%(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=32 * MiB, help="largest request body (default: 32 MiB)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds to let running requests finish after SIGTERM or Ctrl-C (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request at startup")


def _bind(host: str, port: int) -> socket.socket:
    if not (isinstance(port, int) and 0 <= port <= 65535):
        raise UserInputError(f"port={port!r}: expected an integer in [0, 65535]")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserInputError(f"host={host!r}: expected an address to bind ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserInputError(f"port={port} on host={host!r}: cannot bind ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


def summary(engine, name: str) -> str:
    cfg, plan = engine.config, engine.model.memory
    draft = plan.num_slots * plan.draft_bytes_per_slot / MiB
    return (f"serving {name!r}: model {cfg.model_path}, algorithm {cfg.speculative_algorithm}, "
            f"k {engine.model.num_steps}, KV {plan.kv_tokens} tokens ({plan.num_pages} pages of {plan.page_size}), "
            f"draft memory {draft:.1f} MiB, device {cfg.device}, dtype {cfg.dtype}, "
            f"{cfg.max_running_req} running requests at most, max_model_len {engine.max_model_len}")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn  # here, not at the top: ``ft generate`` builds this parser without loading the server
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from ..engine.config import engine_config_from_args
    from ..engine.engine import Engine
    from ..engine.warmup import warm_up
    from .app import ServeSettings, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if not (isinstance(args.drain_timeout, (int, float)) and args.drain_timeout >= 0):
        raise UserInputError(f"drain_timeout={args.drain_timeout!r}: expected a number of seconds >= 0")
    config = engine_config_from_args(args)
    default_name = args.model or Path(config.model_path).parent.name  # the bundled pair's name
    settings = ServeSettings(served_model_name=args.served_model_name or default_name, api_key=args.api_key,
                             max_queued_requests=args.max_queued_requests, max_request_bytes=args.max_request_bytes)
    sock = _bind(args.host, args.port)  # first: a port in use should not wait for the model to load
    host, port = sock.getsockname()[:2]
    start = time.perf_counter()
    with logging_redirect_tqdm(), tqdm(total=2, desc="ft serve", unit="stage", file=sys.stderr, leave=False,
                                       disable=None,  # a bar on a terminal only, not in a log file
                                       bar_format="{desc}: {bar} {n_fmt}/{total_fmt} {postfix}") as bar:
        bar.set_postfix_str("loading the model and allocating the caches")
        engine = Engine(config)
        bar.update()
        if not args.no_warmup:
            bar.set_postfix_str("warm-up: compiling kernels, capturing graphs")
            try:
                warm = warm_up(engine)
            except RuntimeError as exc:
                raise UserInputError(str(exc)) from exc
            logger.info("warm-up: %d requests in %.1f s", warm["requests"], warm["seconds"])
        bar.update()
    logger.info("%s; ready in %.1f s", summary(engine, settings.served_model_name), time.perf_counter() - start)
    sock.listen(2048)  # connections from here on queue until uvicorn accepts them
    logger.info("listening on http://%s:%d (OpenAI API under /v1; /health, /metrics)", host, port)
    app = create_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout,
                                           access_log=args.log_level == "debug", lifespan="on"))
    # uvicorn restores the handlers it found and re-raises the signal that stopped it: with these in
    # place, a drained shutdown ends here and exits 0 instead of dying of that signal
    caught: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, frame: caught.append(number))
    server.run(sockets=[sock])
    logger.info("stopped%s", f" by {signal.Signals(caught[0]).name}" if caught else "")
    return 0
