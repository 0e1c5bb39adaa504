"""The live-server harness of tests/serve: ``start`` runs ``create_app`` under uvicorn in a thread of the
test process on 127.0.0.1 (so a test can also look at its engine); ``Live`` is its handle.

``Live.client()`` is an ``openai.OpenAI`` without retries; ``Live.http()`` an httpx client with the
server's key; ``Live.usage()`` reads the engine's pool accounting between steps; ``Live.settle()``
waits until no request is left in flight; ``Live.metrics()`` parses ``/metrics``.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import openai
import uvicorn

from dflash2.fast.engine.config import EngineConfig
from dflash2.fast.engine.engine import Engine, PoolUsage
from dflash2.fast.serve.app import ServeSettings, create_app

MiB = 1 << 20
MODEL = "tiny"


@dataclass(frozen=True)
class Tiny:
    target: Path
    draft: Path


@dataclass
class Live:
    url: str
    app: object
    uvicorn: uvicorn.Server
    thread: threading.Thread
    api_key: str | None = None

    @property
    def server(self):
        return self.app.state.server

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", self.api_key or "unused"),
                             max_retries=0, timeout=kw.pop("timeout", 60), **kw)

    def http(self, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), headers=headers, **kw)

    def usage(self) -> PoolUsage:
        return self.server.loop.call(lambda engine: engine.pool_usage()).result(timeout=30)

    def settle(self, timeout: float = 30) -> PoolUsage:
        """Wait until every request has finished or been aborted; the pools then."""
        deadline = time.monotonic() + timeout
        while True:
            usage = self.usage()
            if self.server.loop.in_flight == 0 and usage.running == 0 and usage.waiting == 0:
                return usage
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still in flight after {timeout} s: {self.server.loop.in_flight}, "
                                     f"{usage}")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {'name{labels}': value}, the model_name label dropped."""
        out = {}
        for line in self.http().get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                base, _, labels = name.partition("{")
                kept = [kv for kv in re.findall(r'\w+="[^"]*"', labels) if not kv.startswith("model_name=")]
                out[base + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
        return out

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not stop"


def start(tiny: Tiny, settings: ServeSettings | None = None, **engine_args) -> Live:
    args = dict(model_path=str(tiny.target), cpu_cache_bytes=32 * MiB, max_model_len=256, max_running_req=4)
    if engine_args.get("speculative_algorithm") == "dflash":
        args["speculative_draft_model_path"] = str(tiny.draft)
    engine = Engine(EngineConfig(**{**args, **engine_args}))
    settings = settings or ServeSettings(served_model_name=MODEL)
    app = create_app(engine, settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return Live(f"http://127.0.0.1:{sock.getsockname()[1]}", app, server, thread, settings.api_key)


def settings(**kw) -> ServeSettings:
    return replace(ServeSettings(served_model_name=MODEL), **kw)
