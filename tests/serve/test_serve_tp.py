"""``ft serve`` over a tensor-parallel engine (tensor_parallel_size=2, gloo on the CPU): the server's engine thread
drives rank 0 and its broadcasts, so concurrent completions come back as a tp=1 server's do (greedy; plain decoding
and DFlash), and the worker process exits when the engine is closed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_harness import MODEL, start

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def", "for i in range(10):"]


def _completions(live) -> list[str]:
    client = live.client()

    def one(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: one batch of prefills, then decode steps together
        return list(pool.map(one, PROMPTS))


@pytest.mark.parametrize("algorithm", ["none", "dflash"])
def test_tensor_parallel_server_answers_as_one_rank(tiny, algorithm):
    single = start(tiny, speculative_algorithm=algorithm)
    try:
        want = _completions(single)
    finally:
        single.stop()
    live = start(tiny, tensor_parallel_size=2, speculative_algorithm=algorithm)
    workers = live.engine.workers
    try:
        assert workers is not None and all(p.is_alive() for p in workers.processes)
        assert _completions(live) == want
    finally:
        live.stop()
        live.engine.close()
    assert all(not p.is_alive() and p.exitcode == 0 for p in workers.processes)
