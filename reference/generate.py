"""Plain (non-speculative) decoding with the reference target: the baseline every engine must equal.

Given prompt ids x_0..x_{n-1}, the target runs over the prompt once (prefill), then one token at
a time. The token at position p is argmax(logits_{p-1}) when greedy, else the inverse-CDF draw of
the filtered distribution p_{p-1} (``reference/speculative/sampling.py``) with the uniform
``rng.uniform(seed, p, Purpose.SAMPLE)``. Generation ends after ``max_tokens`` tokens, at a stop
id (unless ``ignore_eos``), or at a stop string (the text is cut before it).

With a prefix-cache ``store`` (``reference/speculative/prefix.py``) the request starts from the
longest snapshot that begins its prompt, prefills in chunks ending at multiples of
``snapshot_interval`` (a snapshot at each) and leaves one at its last committed position: the
prompt and every output token but the last, which never ran through the target.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .formats.errors import RequestError
from .request.rng import Purpose, uniform
from .speculative.prefix import PrefixStore, prefill, restore_longest, take_snapshot
from .speculative.sampling import greedy_token, sample_from_probs, target_probs
from .request.sampling_params import SamplingParams
from .request.stopping import Stopper, timing
from .model.target import ReferenceTarget


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"
    text: str = ""
    timing: dict[str, float] = field(default_factory=dict)


def check_prompt(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_context: int) -> None:
    """Refuse an empty prompt, out-of-vocabulary ids, or a request longer than the context."""
    if len(prompt_ids) == 0:
        raise RequestError("prompt: expected at least one token, got an empty prompt")
    bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise RequestError(f"prompt token ids {bad[:5]}: expected integers in [0, {vocab_size})")
    total = len(prompt_ids) + params.max_tokens
    if total > max_context:
        raise RequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total}: expected at most "
            f"the model's context of {max_context} tokens")


def next_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token placed at ``position`` given the logits of the row before it  # logits [V]."""
    if params.greedy:
        return greedy_token(logits)
    return sample_from_probs(target_probs(logits, params), uniform(params.seed, position, Purpose.SAMPLE))


def generate(
    target: ReferenceTarget,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stop_token_ids: Sequence[int] = (),
    decode: Callable[[list[int]], str] | None = None,
    snapshot_interval: int | None = None,
    store: PrefixStore | None = None,
) -> GenerationResult:
    """Decode one request token by token. ``decode`` turns ids into text (needed for stop strings);
    ``snapshot_interval`` and ``store``: the prefix cache (the module docstring)."""
    cfg = target.cfg
    check_prompt(prompt_ids, params, cfg.vocab_size, cfg.max_position_embeddings)
    stopper = Stopper(params, stop_token_ids, decode)
    start = time.perf_counter()
    prompt = list(prompt_ids)
    cache = restore_longest(target, None, prompt, store)
    logits = prefill(target, None, prompt, cache, snapshot_interval, store).logits[-1]
    prefill_end = time.perf_counter()
    out: list[int] = []
    while True:
        out.append(next_token(logits, params, len(prompt_ids) + len(out)))
        out, finish = stopper.check(out)
        if finish is not None:
            break
        logits = target.forward(torch.tensor([out[-1]]), cache).logits[-1]
    if store is not None:
        store.put(take_snapshot(prompt + out[:-1], cache, None))
    return GenerationResult(list(prompt_ids), out, finish, stopper.final_text(out),
                            timing(start, prefill_end, time.perf_counter(), len(out)))
