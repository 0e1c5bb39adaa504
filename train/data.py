"""Token streams and batches: random windows of the train split, fixed windows of the held-out one.

The corpus is tokenized once per machine into ``<run>/tokens-<split>.npy`` (uint16, documents
joined by ``<|endoftext|>``). A training batch is ``batch_size`` windows of ``seq_len + 1`` tokens
at offsets drawn from a generator keyed by (seed, step), so a resumed stage sees the same batches
it would have seen without the interruption. Windows may span a document boundary, as in any
packed pre-training; the end-of-text token between documents is what the model learns there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash2.reference.formats.errors import UserInputError


class TokenStream:
    """One split's tokens, ``[n]`` uint16 on the host (pinned when a GPU will read it)."""

    def __init__(self, tokens: np.ndarray):
        if tokens.ndim != 1 or tokens.dtype != np.uint16:
            raise UserInputError(f"token stream shape {tokens.shape} dtype {tokens.dtype}: expected 1-D uint16")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))  # [n]; int64 so indexing needs no cast later
        self.size = int(tokens.shape[0])

    def train_batch(self, seed: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """``[batch_size, seq_len + 1]`` long: inputs are ``[:, :-1]``, next-token labels ``[:, 1:]``."""
        span = seq_len + 1
        if self.size < span:
            raise UserInputError(f"seq_len={seq_len}: the token stream has only {self.size} tokens")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.size - span + 1, (batch_size,), generator=gen)  # [N]
        return self.tokens[starts[:, None] + torch.arange(span)]  # [N, span]

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int) -> list[torch.Tensor]:
        """Consecutive non-overlapping windows from the start: the same every call."""
        span = seq_len + 1
        count = min(max_batches * batch_size, self.size // span)
        if count == 0:
            raise UserInputError(f"seq_len={seq_len}: the held-out stream has only {self.size} tokens")
        windows = self.tokens[: count * span].view(count, span)
        return [windows[i:i + batch_size] for i in range(0, count, batch_size)]


def load_or_tokenize(run_dir: Path, corpus_dir: Path, tokenizer_dir: Path, split: str) -> TokenStream:
    """The split's tokens, cached in the run folder after the first tokenization."""
    from .tokenizer import tokenize_corpus

    cache = Path(run_dir) / f"tokens-{split}.npy"
    if cache.exists():
        return TokenStream(np.load(cache))
    tokens = tokenize_corpus(corpus_dir, tokenizer_dir, split)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, tokens)
    return TokenStream(tokens)
