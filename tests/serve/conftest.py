"""Fixtures of tests/serve: tiny real-format checkpoints (a tiny-dense target with tokenizer and chat
template, and a DFlash 2 draft, written once) and live servers on them, one per test module."""

from __future__ import annotations

import pytest
from serve_harness import MODEL, ServeSettings, Tiny, start

from dflash2.reference.tiny.draft import write_tiny_draft
from dflash2.reference.tiny.target import write_tiny_target


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp("serve")
    target = write_tiny_target(root / "target", "tiny-dense")
    return Tiny(target, write_tiny_draft(root / "draft", target, seed=3))


@pytest.fixture(scope="module")
def spec(tiny):
    """DFlash speculative decoding at a fixed depth (seeded samples are compared token for token), 4 running
    requests and 32 queued."""
    live = start(tiny, ServeSettings(served_model_name=MODEL, max_queued_requests=32), speculative_algorithm="dflash",
                 speculative_depth="fixed")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def plain(tiny):
    """Plain decoding, contexts of 40 tokens (so any accepted request is short), 4 running and 8 queued."""
    live = start(tiny, ServeSettings(served_model_name=MODEL, max_queued_requests=8), max_model_len=40)
    yield live
    live.stop()
