"""The server's settings: one frozen dataclass, validated once; ``ft serve``'s server flags read their defaults
from it (:func:`add_serve_args`), as the engine flags read ``EngineConfig``'s.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from dflash2.reference.formats.errors import UserInputError

MiB = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServeSettings:
    served_model_name: str | None = None  # the name clients send and /v1/models lists (None: the model as given)
    host: str = "127.0.0.1"  # address to bind (loopback only unless told otherwise)
    port: int = 8000  # 0 picks a free one
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on every /v1 request
    max_queued_requests: int = 256  # requests waiting for admission beyond max_running_req; more get a 429
    max_request_bytes: int = 32 * MiB  # largest request body
    drain_timeout: float = 60.0  # seconds running requests may finish after SIGTERM or Ctrl-C
    log_level: str = "info"
    warmup: bool = True  # compile the kernels and capture the graphs before listening (fast/engine/warmup.py)

    def __post_init__(self) -> None:
        for name, low in (("max_queued_requests", 0), ("max_request_bytes", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise UserInputError(f"{name}={value!r}: expected an integer >= {low}")
        if self.served_model_name is not None and not (isinstance(self.served_model_name, str)
                                                       and self.served_model_name):
            raise UserInputError(f"served_model_name={self.served_model_name!r}: expected a non-empty name")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key):
            raise UserInputError("api_key: expected a non-empty key (or none)")
        if not (isinstance(self.port, int) and not isinstance(self.port, bool) and 0 <= self.port <= 65535):
            raise UserInputError(f"port={self.port!r}: expected an integer in [0, 65535]")
        if not (isinstance(self.drain_timeout, (int, float)) and not isinstance(self.drain_timeout, bool)
                and self.drain_timeout >= 0):
            raise UserInputError(f"drain_timeout={self.drain_timeout!r}: expected a number of seconds >= 0")
        if self.log_level not in LOG_LEVELS:
            raise UserInputError(f"log_level={self.log_level!r}: expected one of {LOG_LEVELS}")


HELP = {
    "served_model_name": "the model name clients send and /v1/models lists (default: --model as given)",
    "host": "address to bind (default: %(default)s, loopback only)",
    "port": "port (default: %(default)s; 0 picks a free one)",
    "api_key": "require 'Authorization: Bearer KEY' on every /v1 request",
    "max_queued_requests": "requests waiting beyond --max-running-requests before new ones get a 429 "
                           "(default: %(default)s)",
    "max_request_bytes": "largest request body (default: 32 MiB)",
    "drain_timeout": "seconds to let running requests finish after SIGTERM or Ctrl-C (default: %(default)s)",
    "log_level": "(default: %(default)s)",
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server flags, defaults read from :class:`ServeSettings` (``warmup`` is ``--no-warmup``)."""
    types = {"port": int, "max_queued_requests": int, "max_request_bytes": int, "drain_timeout": float}
    for f in fields(ServeSettings):
        if f.name == "warmup":
            parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                                help="skip the warm-up requests at startup")
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), type=types.get(f.name, str), default=f.default,
                            choices=LOG_LEVELS if f.name == "log_level" else None, help=HELP[f.name])


def serve_settings_from_args(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings(**{f.name: getattr(args, f.name) for f in fields(ServeSettings)})
