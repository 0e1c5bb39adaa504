"""``ft serve`` as a user runs it: the startup summary, a SIGTERM that drains a running stream before a
clean exit (status 0), and one-line errors (status 2) for a missing model or a port in use."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from dflash2.cli.main import main

FT = str(Path(sys.executable).parent / "ft")


def test_sigterm_drains_a_running_stream_and_exits_cleanly(tiny):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([FT, "serve", "--model", str(tiny.target), "--speculative-algorithm", "dflash",
                             "--speculative-draft-model-path", str(tiny.draft), "--port", "0", "--max-model-len",
                             "512", "--cpu-cache-bytes", str(32 << 20), "--served-model-name", "tiny",
                             "--max-running-requests", "2"],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    listening = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(60), "".join(lines)
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", "".join(lines)).group(1)
        events = []
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 120, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:  # the request is running: stop the server now
                            proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines)
    assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]
    assert sum(e.count('"text"') for e in events[:-1]) == len(events) - 1
    summary = next(line for line in lines if "serving 'tiny'" in line)
    for part in ("algorithm dflash", "k 7", "KV ", "tokens", "draft memory", "device cpu", "2 running requests"):
        assert part in summary, summary
    assert "stopped by SIGTERM" in log and "Traceback" not in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)


def test_a_missing_model_is_a_one_line_error(capsys, tmp_path, monkeypatch):
    assert main(["serve", "--model", str(tmp_path / "nowhere"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nowhere" in err
    from dflash2 import models

    monkeypatch.setattr(models, "ROOT", tmp_path)  # no --model and no bundled pair installed
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--model" in err and "bundled default is missing" in err


def test_a_port_in_use_is_a_one_line_error(tiny, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        code = main(["serve", "--model", str(tiny.target), "--port", str(taken.getsockname()[1]), "--no-warmup",
                     "--cpu-cache-bytes", str(8 << 20), "--log-level", "error"])
    finally:
        taken.close()
    assert code == 2
    assert "cannot bind" in capsys.readouterr().err


def test_bad_server_flags_are_one_line_errors(tiny, capsys):
    for flags, words in ((["--max-queued-requests", "-1"], "max_queued_requests"),
                         (["--drain-timeout", "-5"], "drain_timeout"), (["--port", "70000"], "port")):
        assert main(["serve", "--model", str(tiny.target), "--no-warmup", "--cpu-cache-bytes", str(8 << 20),
                     "--log-level", "error", *flags]) == 2
        assert words in capsys.readouterr().err
