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

import logging
import signal
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

from dflash2.reference.formats.errors import UserInputError

from ..engine.config import EngineConfig
from .settings import ServeSettings

logger = logging.getLogger("dflash2.fast.serve")
MiB = 1 << 20


def _bind(host: str, port: int) -> socket.socket:
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
            f"k {engine.model.k}, KV {plan.kv_tokens} tokens ({plan.num_pages} pages of {plan.page_size}), "
            f"draft memory {draft:.1f} MiB, device {cfg.device}, dtype {cfg.dtype}, "
            f"{cfg.max_running_req} running requests at most, max_model_len {engine.max_model_len}, "
            + (f"prefix cache {plan.num_snapshots} snapshot slots ({plan.num_snapshots * plan.snapshot_bytes / MiB:.1f} "
               f"MiB; {engine.model.num_checkpoints} of them request checkpoints) every {cfg.prefix_snapshot_interval} "
               "tokens" if plan.num_snapshots else "no prefix cache"))


def run_serve(config: EngineConfig, settings: ServeSettings, *, model_given: str | None = None) -> int:
    """Serve ``config``'s model with ``settings`` until SIGTERM or Ctrl-C (module docstring). ``model_given``: the
    ``--model`` as the user gave it, the default served name (None: the bundled pair, named by its folder)."""
    import uvicorn  # here, not at the top: the command line builds its parser without loading the server
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from ..engine.engine import Engine
    from ..engine.warmup import warm_up
    from .app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    default_name = model_given or Path(config.model_path).parent.name  # the bundled pair's name
    settings = replace(settings, served_model_name=settings.served_model_name or default_name)
    sock = _bind(settings.host, settings.port)  # first: a port in use should not wait for the model to load
    host, port = sock.getsockname()[:2]
    start = time.perf_counter()
    with logging_redirect_tqdm(), tqdm(total=2, desc="ft serve", unit="stage", file=sys.stderr, leave=False,
                                       disable=None,  # a bar on a terminal only, not in a log file
                                       bar_format="{desc}: {bar} {n_fmt}/{total_fmt} {postfix}") as bar:
        bar.set_postfix_str("loading the model and allocating the caches")
        engine = Engine(config)
        bar.update()
        if settings.warmup:
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
    server = uvicorn.Server(uvicorn.Config(app, log_level=settings.log_level,
                                           timeout_graceful_shutdown=settings.drain_timeout,
                                           access_log=settings.log_level == "debug", lifespan="on"))
    # uvicorn restores the handlers it found and re-raises the signal that stopped it: with these in
    # place, a drained shutdown ends here and exits 0 instead of dying of that signal
    caught: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, frame: caught.append(number))
    server.run(sockets=[sock])
    logger.info("stopped%s", f" by {signal.Signals(caught[0]).name}" if caught else "")
    return 0
