"""Startup warm-up: compile and capture what a first wave of requests would otherwise wait for.

On CUDA the first use of a shape compiles its Triton kernels (about a second each on a machine
whose Triton cache is cold) and captures its CUDA graph (two eager runs and a capture per batch
bucket). A server that listens cold makes its first clients pay for all of it: with a single 1-token
warm-up request the first wave of a load run waited ten times longer for its first token than the
waves after it (measured: bench/results/2026-12-01-h200-serve/). One more request then fills a prefill
chunk alone (a long prompt's chunk takes other kernels than many short prompts'), and, with a prefix
cache, each wave's request takes a second turn through a cache hit.

Where the engine captures prefill steps (``graphs/prefill_graphs.py``, one per row bucket, with
``prefill_graph_rows`` set), they are captured first, all of them, so the waves' short chunks replay them and no
client's chunk waits for a capture.

``warm_up`` runs two waves of ``max_running_req`` requests before the server listens, greedy and
then sampled the way most clients sample (temperature and top-p, top-k off), so the filter's and
the draws' kernels compile and speculative steps capture the step graphs of both. A speculative
step graph is keyed by its batch's sampling summary (``runner.graph_summary``), so other mixes
(top-k on, no filter at all) still capture on their first step. Their prompts together fill one prefill chunk,
so the prefill kernels compile at the row counts a full chunk uses; request i asks for
(i + 1) (k + 1) + 1 tokens (k drafts per step, 0 for plain decoding), so the decode (or verify)
batch shrinks from ``max_running_req`` to 1 and every batch bucket is stepped (a speculative step replays
its k's capture even where requests near their end verify fewer drafts; where drafts are accepted, requests
finish sooner and a bucket may be left to first use). An adaptive depth
(``fast/speculative/depth.py``) runs both waves at its deepest depth and a greedy wave at each other one, so its
every depth is captured and priced per bucket before the first request. Longer contexts (wider
page tables) still capture on first use, one bucket at a time.
"""

from __future__ import annotations

import time

from dflash2.reference.request.sampling_params import SamplingParams

from .engine import Engine
from .memory import log_reached
from .prefix_cache import PrefixStats


def warm_up(engine: Engine) -> dict:
    """Run the warm-up waves; returns ``{"requests", "seconds"}``. Raises RuntimeError if one fails."""
    cfg = engine.config
    n = cfg.max_running_req
    stride = (engine.k or 0) + 1
    # a short context (--max-model-len) caps the outputs: warm-up must never be refused for length
    lengths = [max(1, min(stride * (i + 1) + 1, engine.max_model_len - 2)) for i in range(n)]
    longest_output = lengths[-1]
    prompt_len = max(1, min(cfg.max_num_batched_tokens // n, engine.max_model_len - longest_output - 1))
    vocab = engine.model.target.cfg.vocab_size
    prompts = [[(7 * i + j) % vocab for j in range(prompt_len)] for i in range(n)]
    waves = ([SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths],
             [SamplingParams(max_tokens=m, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
              for i, m in enumerate(lengths)])
    started = time.perf_counter()
    requests = 0
    if engine.runner.prefill_graphs is not None:  # every short prefill step's graph, so the waves replay them
        engine.runner.prefill_graphs.capture_all()
    policy = engine.depth if engine.depth is not None and engine.depth.adaptive else None
    # an adaptive depth runs each of its depths: both waves at the deepest, a greedy wave at each other one
    plan = [(engine.k if policy else None, wave) for wave in waves]
    plan += [(depth, waves[0]) for depth in (policy.depths[:-1] if policy else ())]
    outs = []
    for depth, wave in plan:
        if depth is not None:
            engine.scheduler.depth = lambda num_seqs, depth=depth: depth
        outs = engine.generate(prompts, wave)
        for out in outs:
            if out.error is not None:
                raise RuntimeError(f"warm-up request failed: {out.error}")
        requests += n
    greedy_pair = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # one prompt filling a chunk alone: a sequence of that many rows takes other kernels than the waves' short ones
    # (the GDN layers' chunked form past delta_rule.SHORT_PREFILL_ROWS rows, autotuned on first use)
    long_len = min(cfg.max_num_batched_tokens, engine.max_model_len - 3)
    if long_len > prompt_len:
        for out in engine.generate([[(11 * j + 5) % vocab for j in range(long_len)]], [greedy_pair]):
            if out.error is not None:
                raise RuntimeError(f"warm-up request failed: {out.error}")
        requests += 1
    if engine.prefix_cache is not None and engine.max_model_len > prompt_len + longest_output + 2:
        # a prefix-cache hit (a second turn after each finish): the restore's copies and ring rebuild compile now
        turns = [p + o.token_ids + [1] for p, o in zip(prompts, outs)]
        turns = [t for t in turns if len(t) + 2 <= engine.max_model_len]
        for out in engine.generate(turns, [greedy_pair] * len(turns)):
            if out.error is not None:
                raise RuntimeError(f"warm-up request failed: {out.error}")
        requests += len(turns)
    if engine.prefix_cache is not None:
        engine.clear_prefix_cache()  # serving starts from an empty cache and counts only its own lookups
        engine.prefix_cache.stats = PrefixStats()
    if policy is not None:  # keep the step costs measured, not the warm-up prompts' acceptance
        engine.scheduler.depth = policy.choose
        policy.forget_acceptance()
    device = engine.model.pools.device
    if device.type == "cuda":  # every graph is captured now: what the memory plan estimated, beside what was reached
        log_reached(device, cfg.memory_ratio)
    return {"requests": requests, "seconds": time.perf_counter() - started}
