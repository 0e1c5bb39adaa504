"""Captured prefill steps: short prefill chunks (a chat turn resumed from the prefix cache, a few short prompts)
replayed as CUDA graphs instead of launched layer by layer.

Why: a prefill step of a few hundred rows does little work per kernel, and launched eagerly it is bound by the
host. On the 35B-A3B shape (H100) a chat turn of 129 rows ran 34 ms of kernels in 122-147 ms of wall, eight such
turns 58 ms in 125-154 ms (about 3,000 launches a forward: bench/results/2026-12-07e-h100-serve-prefill/). A
replay launches them from the device.

What a capture fixes, and how a ragged chunk fits it. A key is a row bucket ``Nb`` (64, 128, 256, 512, then
every 256 rows up to ``max_rows``: :func:`row_buckets`); its graph runs ``seqs = max_seqs + X`` sequences over ``rows = Nb + seqs`` rows with
``max_query_len = Tq = min(Nb, SHORT_PREFILL_ROWS)``. A step of b <= ``max_seqs`` chunks and n <= Nb rows, each
chunk at most Tq rows, fills it as:

- sequences 0..b-1: the chunks, their rows first and in order (so the real rows are rows 0..n-1, as eagerly);
- sequences b..seqs-1: padding sequences that share the other ``rows - n`` rows, each 1..Tq of them (state slot
  and K/V slots ``PAD_SLOT``: they read the zero state, write only the trash slot and row, see no key).

X = ceil((Nb + max_seqs) / (Tq - 1)) padding sequences at least are what make that always possible: with p
padding sequences (p >= X) and r = rows - n padding rows, p <= r (n <= Nb) and r <= Nb + p <= p Tq. No sequence
has zero rows (no kernel need handle one), and no sequence has more than Tq rows, so every kernel's
``max_query_len`` bound holds and padding rows never mix with real ones (rows are independent in every op but
attention and the GDN recurrence, which are per sequence).

Every op of the forward then reads the step's layout from device tensors: the paged-attention prefill kernel
needs only the bound Tq, the GDN layers take the recurrence in place (one launch a layer, looping to each
sequence's own length: ``delta_rule.SHORT_PREFILL_ROWS``, which is why a chunk may have at most that many rows),
the MoE's router and grouped GEMM are sync-free at the bucket's row count. The proposer's ``observe`` of the
chunk's rows (DFlash: the window and ring; MTP: its pairs) is captured with the forward; the LM head runs on
``max_seqs`` rows (the chunks that complete a prompt first). The first token is drawn eagerly from those logits
(``runner.py``).

One more key takes a single chunk of exactly ``max_rows`` rows (past Tq), unpadded: every chunk but the last of a
long prompt when ``max_rows`` is the step's budget (``max_num_batched_tokens``, the default). Its GDN layers take
fla's chunked kernels, which need no host read of a sequence table for one sequence (``delta_rule._prefill_fla``).
A cold prefill step is host-bound too: a 4,096-token prompt of the 35B-A3B ran 121 ms of kernels in 236-267 ms.

Not captured (eager, ``eager_step.py``): any other chunk longer than Tq rows, past ``max_rows`` rows in all, more than
``max_seqs`` chunks, a step asking for logprobs, tensor parallelism (its workers mirror eager
forwards only), CPU tensors (on the CPU a "replay" runs the step function on the static fields: the CPU lane tests
the padding and the fill, not the capture). The engine makes these graphs where ``EngineConfig.prefill_graph_rows``
is not 0 (off by default until a GPU has captured and measured them); its warm-up captures every key
(:meth:`capture_all`), each in
the pool of this class alone, so the memory plan allows it one forward of the largest key's rows
(``memory.activation_bytes``) and every capture's outputs (:func:`outputs_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...kernels.gdn.delta_rule import SHORT_PREFILL_ROWS
from ...model.batch import PAD_SLOT, ForwardBatch
from ...model.pools import CachePools
from ...model.target import FastOutput, FastTarget
from .graph_step import CapturedStep
from .step_buffers import StaticInputs, StepFields, fill_values, real_rows

MIN_ROWS = 64  # the smallest row bucket (a chunk of fewer rows pads to it: fewer captures, not measured against more)
# past DOUBLING_ROWS the buckets grow by this many rows, not by doubling: eight 129-row chat turns (1,032 rows) pad
# to 1,280 rows, not to 2,048 (the MoE's rows cost the grouped GEMM's, and every padded row runs every layer)
BUCKET_STEP = 256
DOUBLING_ROWS = 512


@dataclass(frozen=True)
class PrefillKey:
    bucket: int  # Nb: the real rows it takes, at most
    max_query_len: int  # Tq: the rows any one sequence may have
    seqs: int  # sequences in the graph (max_seqs real ones, the rest padding)
    rows: int  # rows in the graph: Nb + seqs
    pages: int  # page-table width (the model's maximum)
    logits: int  # LM-head rows (max_seqs)


def row_buckets(max_rows: int) -> list[int]:
    """The row buckets: 64, 128, 256, 512 (doubling), then every ``BUCKET_STEP`` rows; the last one ``max_rows``."""
    sizes, n = [], MIN_ROWS
    while n < max_rows:
        sizes.append(n)
        n = n * 2 if n < DOUBLING_ROWS else n + BUCKET_STEP
    return sizes + [max_rows]


def prefill_key(bucket: int, *, max_seqs: int, pages: int) -> PrefillKey:
    """The graph shape of row bucket ``bucket`` (module docstring: Tq, the padding sequences X)."""
    tq = min(bucket, SHORT_PREFILL_ROWS)
    extra = -(-(bucket + max_seqs) // max(1, tq - 1))
    seqs = max_seqs + extra
    return PrefillKey(bucket, tq, seqs, bucket + seqs, pages, max_seqs)


def padding_lengths(rows: int, seqs: int, max_query_len: int) -> list[int]:
    """``rows`` padding rows shared by ``seqs`` padding sequences, each 1..max_query_len rows (as even as can be)."""
    if not seqs <= rows <= seqs * max_query_len:
        raise ValueError(f"{rows} padding rows cannot fill {seqs} sequences of 1..{max_query_len} rows")
    if not seqs:  # a key of one whole chunk: no padding
        return []
    base, extra = divmod(rows, seqs)
    return [base + 1] * extra + [base] * (seqs - extra)


def field_sizes(key: PrefillKey) -> dict[str, int]:
    b, n = key.seqs, key.rows
    return {"cu_seqlens": b + 1, "state_slots": b, "block_tables": b * key.pages, "logits_rows": key.logits,
            "positions": n, "kv_slot_mapping": n, "context_lens": b, "tokens": n}


def fill_prefill(host: StepFields[np.ndarray], key: PrefillKey, *, starts: Sequence[int], lengths: Sequence[int],
                 slots: Sequence[int], tables: Sequence[Sequence[int]], tokens: Sequence[int],
                 logits_rows: Sequence[int], page_size: int) -> None:
    """Write the padded batch of the chunks (chunk b: ``lengths[b]`` rows from position ``starts[b]``, GDN slot
    ``slots[b]``, pages ``tables[b]``; ``tokens``: their rows' ids, in order) into ``key``'s host fields."""
    num_real = len(lengths)
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.sum())
    pads = padding_lengths(key.rows - n, key.seqs - num_real, key.max_query_len)
    all_lengths = np.concatenate([lengths, np.asarray(pads, dtype=np.int64)])
    cu = host.cu_seqlens
    cu[0] = 0
    np.cumsum(all_lengths, out=cu[1:])
    seq = np.repeat(np.arange(key.seqs), all_lengths)  # [rows]
    all_starts = np.zeros(key.seqs, dtype=np.int64)
    all_starts[:num_real] = starts
    positions = all_starts[seq] + np.arange(key.rows) - cu[:-1][seq]
    host.positions[:] = positions
    fill_values(host.state_slots, slots, PAD_SLOT)
    table = host.block_tables.reshape(key.seqs, key.pages)
    table[:] = PAD_SLOT
    for i, pages in enumerate(tables):
        pages = np.asarray(pages, dtype=np.int64)
        table[i, :pages.size] = pages
    host.kv_slot_mapping[:] = PAD_SLOT
    real = positions[:n]
    pages = table[seq[:n], real // page_size]
    host.kv_slot_mapping[:n] = pages * page_size + real % page_size
    host.context_lens[:] = 0
    host.context_lens[:num_real] = all_starts[:num_real] + lengths
    fill_values(host.tokens, tokens, 0)
    fill_values(host.logits_rows, logits_rows, 0)


class PrefillGraphs:
    """Captured prefill forwards (and the proposer's observe of their rows), one per row bucket."""

    def __init__(self, target: FastTarget, pools: CachePools, proposer=None, *, max_seqs: int, max_pages: int,
                 max_rows: int):
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows}: expected >= 1")
        self.target, self.pools, self.proposer = target, pools, proposer
        self.device, self.page_size = pools.device, pools.page_size
        self.max_seqs, self.max_pages, self.max_rows = max_seqs, max_pages, max_rows
        self.keys = [prefill_key(n, max_seqs=max_seqs, pages=max_pages) for n in row_buckets(max_rows)]
        # one sequence of exactly max_rows rows (every chunk but the last of a long prompt, when max_rows is the
        # step's budget), unpadded: the GDN layers take fla's chunked kernels, with no sequence table to read on
        # the host for one sequence (delta_rule._prefill_fla)
        self.full = None
        if max_rows > self.keys[-1].max_query_len:
            self.full = PrefillKey(max_rows, max_rows, 1, max_rows, max_pages, 1)
        self.graphs: dict[PrefillKey, CapturedStep] = {}
        self.mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.replays = 0  # steps run through a capture (tests, diagnostics)

    @property
    def max_chunk_rows(self) -> int:
        """The longest chunk a capture takes (the largest key's Tq)."""
        return self.keys[-1].max_query_len

    def key_for(self, lengths: Sequence[int]) -> PrefillKey | None:
        """The key chunks of ``lengths`` rows replay, or None when they must run eagerly (module docstring)."""
        n = sum(lengths)
        if not lengths or len(lengths) > self.max_seqs or n > self.max_rows:
            return None
        if self.full is not None and len(lengths) == 1 and n == self.full.rows:
            return self.full
        key = next(k for k in self.keys if k.bucket >= n)
        return key if max(lengths) <= key.max_query_len else None

    def capture_all(self) -> int:
        """Capture every key not yet captured (the warm-up); returns how many were."""
        missing = [key for key in self.keys + [self.full] if key is not None and key not in self.graphs]
        for key in missing:
            self._capture(key)
        return len(missing)

    def run(self, key: PrefillKey, *, starts: Sequence[int], lengths: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]], tokens: Sequence[int],
            logits_rows: Sequence[int]) -> tuple[ForwardBatch, FastOutput]:
        """One replay of the chunks (``fill_prefill``'s arguments); returns the real chunks' batch and output
        (``logits`` for ``logits_rows``), views of static memory valid until the next replay of this key. The
        proposer (if any) has observed the rows."""
        step = self.graphs.get(key) or self._capture(key)
        host = step.inputs.begin_fill()
        fill_prefill(host, key, starts=starts, lengths=lengths, slots=slots, tables=tables, tokens=tokens,
                     logits_rows=logits_rows, page_size=self.page_size)
        step.inputs.upload()
        batch, out = step.replay()
        self.replays += 1
        n, m = int(sum(lengths)), len(logits_rows)
        return (real_rows(batch, len(lengths), n, m),
                FastOutput(out.logits[:m], out.hidden[:n], out.taps[:n]))

    def _capture(self, key: PrefillKey) -> CapturedStep:
        inputs = StaticInputs(field_sizes(key), self.device)
        host = inputs.begin_fill()
        fill_prefill(host, key, starts=[], lengths=[], slots=[], tables=[], tokens=[], logits_rows=[],
                     page_size=self.page_size)  # all padding: the capture's runs touch only the trash slot and row
        inputs.upload()

        def forward(fields: StepFields) -> tuple[ForwardBatch, FastOutput]:
            batch = ForwardBatch(
                token_ids=fields.tokens, positions=fields.positions, cu_seqlens=fields.cu_seqlens.to(torch.int32),
                state_slots=fields.state_slots, kv_slot_mapping=fields.kv_slot_mapping,
                block_tables=fields.block_tables.view(key.seqs, key.pages).to(torch.int32),
                context_lens=fields.context_lens, is_verify=False, logits_rows=fields.logits_rows,
                max_query_len=key.max_query_len)
            out = self.target.forward(batch, self.pools)
            if self.proposer is not None:
                self.proposer.observe(batch, out, None)
            return batch, out

        step = CapturedStep(inputs, forward, self.device, self.mempool)
        self.graphs[key] = step
        return step


def graph_rows(max_rows: int, max_seqs: int) -> int:
    """The rows of the largest prefill graph of an engine whose prefill steps capture up to ``max_rows`` rows
    (0: none): the forward whose activations the memory plan allows the pool."""
    return prefill_key(row_buckets(max_rows)[-1], max_seqs=max_seqs, pages=1).rows if max_rows else 0


def outputs_bytes(max_rows: int, max_seqs: int, *, hidden_size: int, num_taps: int, vocab_size: int,
                  itemsize: int) -> int:
    """The outputs every capture keeps in the pool beside the shared temporaries: per key its hidden and taps
    ``[rows, (1 + num_taps) C]`` in the model dtype and its logits ``[logits, V]`` fp32 (0 for ``max_rows`` 0)."""
    if not max_rows:
        return 0
    keys = [prefill_key(n, max_seqs=max_seqs, pages=1) for n in row_buckets(max_rows)]
    if max_rows > keys[-1].max_query_len:
        keys.append(PrefillKey(max_rows, max_rows, 1, max_rows, 1, 1))  # the whole-chunk key
    return sum(k.rows * (1 + num_taps) * hidden_size * itemsize + k.logits * vocab_size * 4 for k in keys)
