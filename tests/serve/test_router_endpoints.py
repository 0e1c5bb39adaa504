"""What a router in front of several ``ft serve`` replicas needs from each (``scripts/serve_replicas.sh``):
``/health``, and ``/server_info`` and ``/model_info``, which ``sglang-router`` reads when a replica registers
(its served name becomes the router's model id, so the router's ``/v1/models`` lists it). The script refuses
bad arguments before it starts anything. With ``sglang-router`` installed (``$SGLANG_ROUTER`` or on PATH), two
live replicas behind the real router: the model is listed, text completions and chat pass through, and a
conversation's second turn goes to the replica that holds its first turn's prefix."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_harness import MODEL, ServeSettings, start

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "serve_replicas.sh"
ROUTER = os.environ.get("SGLANG_ROUTER") or shutil.which("sglang-router")


def test_server_info_and_model_info(spec):
    http = spec.http()
    info = http.get("/server_info").json()
    assert info["served_model_name"] == MODEL and info["engine"] == "dflash2"
    assert info["max_running_requests"] == 4 and info["max_model_len"] == 256
    assert info["speculative_algorithm"] == "dflash" and info["speculative_num_steps"] == spec.engine.model.k
    assert info["max_total_tokens"] == spec.engine.model.memory.kv_tokens and info["prefix_caching"] is True
    model = http.get("/model_info").json()
    assert model == {"model_id": MODEL, "model_type": spec.engine.model.target_cfg.model_type, "is_generation": True,
                     "has_tokenizer": True}
    # open like /health and /metrics, and no local path in either (the checkpoint's folder stays private)
    assert str(spec.engine.config.model_path) not in str(info) + str(model)


def test_the_info_routes_need_no_api_key(tiny):
    live = start(tiny, ServeSettings(served_model_name=MODEL, api_key="k"))
    try:
        bare = httpx.Client(base_url=live.url, timeout=30)
        assert bare.get("/server_info").status_code == 200 and bare.get("/model_info").status_code == 200
        assert bare.get("/v1/models").status_code == 401
    finally:
        live.stop()


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas 0"),
    (["--port", "65535", "--replicas", "2"], "--port 65535"),
    (["--", "--port", "9000"], "ft serve --port"),
    (["--", "--api-key=k"], "ft serve --api-key=k"),
    (["--bogus"], "unknown option --bogus"),
    (["--router-bin", "/nonexistent/sglang-router"], "--router-bin"),
])
def test_serve_replicas_refuses_bad_arguments_before_starting_anything(args, message):
    run = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr and "replica 0:" not in run.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_workers(url: str, n: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
            if sum(w.get("is_healthy", False) for w in workers) >= n:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, "the router did not register the replicas"
        time.sleep(0.25)


@pytest.mark.skipif(ROUTER is None, reason="sglang-router is not installed (pip install sglang-router, or set "
                                           "SGLANG_ROUTER to its executable)")
def test_two_replicas_behind_the_real_router_keep_each_conversation_on_its_replica(tiny):
    """Two conversations start at once (so the router, which sends a new conversation to the least-loaded replica,
    may split them), then each sends a second turn that extends its first prompt: each second turn resumes from
    the snapshot its first turn left (every 16 prompt tokens), which only the replica that ran the first turn
    holds."""
    replicas = [start(tiny, snapshot_interval=16) for _ in range(2)]
    port = _free_port()
    router = subprocess.Popen([ROUTER, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                               "--prometheus-port", str(_free_port()), "--log-level", "warn",
                               "--worker-urls", *(r.url for r in replicas)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_workers(url, 2, router)
        client = httpx.Client(base_url=url, timeout=60)
        # the replicas' /server_info named the model: the router lists it and routes requests for it
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
        chat = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] in ("stop", "length")
        body = {"model": MODEL, "temperature": 0, "ignore_eos": True}
        prompts = ["def alpha(x):\n    return x + 1\n" * 6, "class Beta:\n    value = 2\n" * 6]
        with ThreadPoolExecutor(2) as pool:
            firsts = list(pool.map(lambda p: client.post("/v1/completions", json={**body, "prompt": p,
                                                                                   "max_tokens": 96}).json(), prompts))
        for prompt, first in zip(prompts, firsts):
            before = [r.metrics().get("dflash2_prefix_cache_hits_total", 0) for r in replicas]
            second = client.post("/v1/completions", json={**body, "prompt": prompt + "# next\n", "max_tokens": 2})
            cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == first["usage"]["prompt_tokens"] // 16 * 16 > 0  # its first turn's last boundary
            gained = [r.metrics().get("dflash2_prefix_cache_hits_total", 0) - b for r, b in zip(replicas, before)]
            assert sorted(gained) == [0, cached]
    finally:
        router.terminate()
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
        for r in replicas:
            r.stop()
