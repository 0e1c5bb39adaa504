"""The engine thread binds itself to the engine's CUDA device, and never fails on a bare ``cuda``.

Seen on the H200: ``ft serve`` built its engine on ``cuda`` (no index) and the engine thread's
``torch.cuda.set_device(torch.device("cuda"))`` raised, so the server answered every request 503.
"""

from __future__ import annotations

import torch

from dflash2.fast.serve import engine_loop


def test_bind_thread_to(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(device))
    engine_loop.bind_thread_to(torch.device("cpu"))
    engine_loop.bind_thread_to(torch.device("cuda"))  # the current device: nothing to bind
    assert calls == []
    engine_loop.bind_thread_to(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]
