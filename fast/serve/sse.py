"""Server-sent events: the streaming response and its framing.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n`` (OpenAI's framing). An
error after the stream has started is one ``data: {"error": {...}}`` event (the ``openai`` client
raises it as an ``APIError``) before ``[DONE]``.

:class:`EventStream` always listens for the client's disconnect while it streams, whatever ASGI
version the server speaks: on disconnect the body generator is cancelled where it waits, and its
``finally`` aborts the engine requests, so their KV pages, state slot and ring return at once,
even for a request still queued (which sends nothing that could fail); ``on_close`` runs in every
case, also when the generator never started.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), allow_nan=False)}\n\n"


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, *, on_close: Callable[[], None] | None = None, **kw):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kw.pop("headers", {})}
        super().__init__(content, headers=headers, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def run(func) -> None:
                    await func()
                    group.cancel_scope.cancel()

                group.start_soon(run, partial(self.stream_response, send))
                await run(partial(self.listen_for_disconnect, receive))
        finally:  # also when the client left before the body generator ever started (its finally never runs)
            if self.on_close is not None:
                self.on_close()
