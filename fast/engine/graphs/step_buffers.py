"""Static buffers and buckets of the captured steps: the keys, the typed fields, their one-copy uploads.

A captured step (``graph_step.py``) replays on fixed device memory. Its key says which shape it was captured
for::

    GraphKey(num_seqs=B bucket, rows_per_seq=R, pages=P bucket, is_verify, sampling summary)

the B bucket the smallest of 1, 2, 4, 8, ... (capped at max_running_req) that holds the batch, the P bucket
the next power of two of the pages any sequence needs (at least :data:`MIN_PAGES`, capped at the model's
maximum), R = 1 for a decode and k + 1 for a verify.

Its inputs are a :class:`StepFields`: the ForwardBatch fields padded to the key (``fast/model/batch.py``'s
padding: padding sequences have R rows each, state slot and K/V slots ``PAD_SLOT``, no pages and context
length 0, so they read the zero state, write only the trash slot and row and change nothing a real row
reads), the requests' sampling parameters (padding requests are greedy), and per kind of step the rows'
tokens and draw positions (a decode) or each request's anchor token and position and the drafts it verifies (a
speculative step: every request runs k + 1 rows, and one near its max_tokens verifies only its first k_b of them,
so a step whose requests draft different k replays the same capture).

:class:`StaticInputs` keeps those fields, int64 and fp32, in one device buffer with a pinned host twin whose
fields are numpy views: a step's fill is a few numpy writes (torch's CPU ops cost microseconds of dispatch
each, on the step's critical path) and its upload one non-blocking copy of a range sliced once. The buffer is
laid out as the early fields, then the late ones, so a speculative step can upload its proposal's fields,
launch the proposal, and only then fill and upload the rest (``graph_step.StepGraphs``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np
import torch
from torch import Tensor

from dflash2.reference.request.sampling_params import SamplingParams

from ...kernels.sampling.philox import seed_bits
from ...model.batch import PAD_SLOT, ForwardBatch

MIN_PAGES = 16

A = TypeVar("A", Tensor, np.ndarray)


def buckets(max_seqs: int) -> list[int]:
    """Batch-size buckets: powers of two below ``max_seqs``, then ``max_seqs`` itself."""
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_seqs]


def page_bucket(pages: int, max_pages: int) -> int:
    """The page-table width a step of ``pages`` pages replays with: a power of two, capped at ``max_pages``."""
    width = MIN_PAGES
    while width < pages:
        width *= 2
    return min(width, max_pages)


def kv_slot_mapping(tables, seq, positions, page_size: int):
    """Flat K/V slot of each row: page ``tables[seq, p // page_size]``, offset ``p % page_size``  # [N].
    Tensors (the eager batch) or numpy arrays (the graphs' host fill) alike."""
    return tables[seq, positions // page_size] * page_size + positions % page_size


@dataclass(frozen=True)
class GraphKey:
    num_seqs: int  # B bucket
    rows_per_seq: int  # R: 1 for decode, k+1 for verify
    pages: int  # page-table width P
    is_verify: bool
    sampling: object = None  # a whole step's HostSummary (which verify kernels can have work), rounded up


@dataclass
class StepFields(Generic[A]):
    """A captured step's static inputs: device views (``StaticInputs.device``) or their host twins (``.host``);
    None where the key's kind of step has no such field."""

    # the ForwardBatch, padded to the key (a speculative step derives the row fields from its anchors on the
    # device, ``speculative_rows``: it has no positions, kv_slot_mapping or context_lens fields)
    cu_seqlens: A  # [B + 1]
    state_slots: A  # [B]
    block_tables: A  # [B P]
    logits_rows: A  # [B R]
    # the requests' sampling parameters (padding requests are greedy)
    temperature: A  # [B] fp32
    top_k: A  # [B]
    top_p: A  # [B] fp32
    seeds: A  # [B] (uint64 bit patterns)
    positions: A | None = None  # [B R]
    kv_slot_mapping: A | None = None  # [B R]
    context_lens: A | None = None  # [B]
    # a decode step: the rows' tokens and the positions each request's next token is drawn at
    tokens: A | None = None  # [B R]
    sample_positions: A | None = None  # [B]
    # a speculative step: each request's anchor token and its position
    anchor_tokens: A | None = None  # [B]
    anchors: A | None = None  # [B]
    draft_limits: A | None = None  # [B] k_b: the drafts each request verifies, <= k (padding requests: k)


FLOAT_FIELDS = frozenset({"temperature", "top_p"})
# what a speculative step's proposal reads (with the state slots): uploaded first when the step is split
PROPOSAL_FIELDS = ("anchor_tokens", "anchors", "top_k", "seeds", "temperature", "top_p", "state_slots")


def field_sizes(key: GraphKey, *, decode: bool) -> dict[str, int]:
    """Each field's length for ``key``: a decode step's fields (``decode``) or a speculative step's."""
    b, r = key.num_seqs, key.rows_per_seq
    sizes = {"cu_seqlens": b + 1, "state_slots": b, "block_tables": b * key.pages, "logits_rows": b * r,
             "temperature": b, "top_k": b, "top_p": b, "seeds": b}
    if decode:
        extra = {"positions": b * r, "kv_slot_mapping": b * r, "context_lens": b, "tokens": b * r, "sample_positions": b}
    else:
        extra = {"anchor_tokens": b, "anchors": b, "draft_limits": b}
    return {**sizes, **extra}


class StaticInputs:
    """Fixed-size int64 and fp32 fields in one device buffer, filled from a pinned host twin (module docstring).

    ``sizes``: each present field's length (the rest are None); ``early``: the fields the ``"early"`` part
    holds. ``device`` and ``host`` are :class:`StepFields` of device views and numpy views.
    """

    def __init__(self, sizes: dict[str, int], device: torch.device, early: Collection[str] = ()):
        unknown = set(sizes) - {f.name for f in fields(StepFields)}
        if unknown:
            raise ValueError(f"fields {sorted(unknown)}: not StepFields fields")
        groups = [(name, n, torch.float32 if name in FLOAT_FIELDS else torch.long) for is_early in (True, False)
                  for is_float in (False, True) for name, n in sizes.items()
                  if (name in early) == is_early and (name in FLOAT_FIELDS) == is_float]
        offsets, nbytes, early_end = [], 0, 0
        for name, n, dtype in groups:
            offsets.append(nbytes)
            nbytes += -(-n * dtype.itemsize // 8) * 8  # the next field 8-byte aligned
            if name in early:
                early_end = nbytes
        cuda = device.type == "cuda"
        device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        host_buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
        host_np = host_buf.numpy()
        views, host = {}, {}
        for (name, n, dtype), at in zip(groups, offsets):
            size = n * dtype.itemsize
            views[name] = device_buf[at:at + size].view(dtype)
            host[name] = host_np[at:at + size].view(np.int64 if dtype == torch.long else np.float32)
        absent = {f.name: None for f in fields(StepFields)}  # a kind of step without a field has it None
        self.device: StepFields[Tensor] = StepFields(**{**absent, **views})
        self.host: StepFields[np.ndarray] = StepFields(**{**absent, **host})
        # (device range, host range) per part, sliced once (a slice costs the host microseconds a step)
        self._parts = {part: (device_buf[lo:hi], host_buf[lo:hi])
                       for part, (lo, hi) in {"all": (0, nbytes), "early": (0, early_end),
                                              "late": (early_end, nbytes)}.items()}
        self._uploaded = torch.cuda.Event() if cuda else None

    def begin_fill(self) -> StepFields[np.ndarray]:
        """The host fields to write (after the previous upload has left the pinned buffers)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        return self.host

    def upload(self, part: str = "all") -> None:
        """Copy the host fields to the device: ``"all"``, or the ``"early"`` fields (a step's first
        graphs read only those) and later the ``"late"`` rest, whose host twins may still be written
        while the early copy is in flight (they are other bytes). One copy either way."""
        device_range, host_range = self._parts[part]
        if device_range.numel():
            device_range.copy_(host_range, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()


def fill_values(field: np.ndarray, values, pad) -> None:
    """``field[:len(values)] = values``, the rest ``pad``."""
    values = np.asarray(values, dtype=field.dtype)
    field[:] = pad
    field[:values.size] = values


def fill_sampling(host: StepFields[np.ndarray], params: Sequence[SamplingParams]) -> None:
    """The requests' sampling parameters; padding requests are greedy."""
    fill_values(host.temperature, [sp.temperature for sp in params], 0.0)
    fill_values(host.top_k, [sp.top_k for sp in params], -1)
    fill_values(host.top_p, [sp.top_p for sp in params], 1.0)
    fill_values(host.seeds, seed_bits(sp.seed for sp in params), 0)


def fill_batch(host: StepFields[np.ndarray], key: GraphKey, *, starts: Sequence[int], slots: Sequence[int] | None,
               tables: Sequence[Sequence[int]], logits_rows: Sequence[int], page_size: int) -> None:
    """Write the padded ForwardBatch fields of ``len(starts)`` real sequences of R rows each (not the tokens).

    starts, slots: B' ints; tables: B' rows of page ids (a sequence's pages in order, at most P; -1 pads);
    logits_rows: M ints (padded with every row after them). Lists, numpy arrays or CPU tensors.
    ``slots=None`` leaves ``state_slots`` as written before (a step that uploaded it early).

    A row at a position its table has no page for writes nothing (``PAD_SLOT``), and the context a sequence's rows
    read stops at its table's width, so no row reads or writes outside its own pages (the rule
    :func:`speculative_rows` applies on the device, where a request near its end runs rows past its pages).
    """
    b, r, p = key.num_seqs, key.rows_per_seq, key.pages
    starts = np.asarray(starts, dtype=np.int64)
    num_seqs = starts.size
    n_real = num_seqs * r
    positions = (starts[:, None] + np.arange(r)).reshape(-1)  # [n_real]
    host.positions[:] = 0
    host.positions[:n_real] = positions
    host.cu_seqlens[:] = np.arange(b + 1) * r
    if slots is not None:
        fill_values(host.state_slots, slots, PAD_SLOT)
    table = host.block_tables.reshape(b, p)
    table[:] = PAD_SLOT
    for i, pages in enumerate(tables):
        pages = np.asarray(pages, dtype=np.int64)
        table[i, :pages.size] = pages
    host.kv_slot_mapping[:] = PAD_SLOT
    if num_seqs:
        seq = np.repeat(np.arange(num_seqs), r)
        page_index = np.minimum(positions // page_size, p - 1)
        pages = table[seq, page_index]
        held = (pages >= 0) & (positions < p * page_size)
        host.kv_slot_mapping[:n_real] = np.where(held, pages * page_size + positions % page_size, PAD_SLOT)
    host.context_lens[:] = 0
    host.context_lens[:num_seqs] = np.minimum(starts + r, p * page_size)
    logits_rows = np.asarray(logits_rows, dtype=np.int64)
    host.logits_rows[:] = np.arange(b * r)
    host.logits_rows[:logits_rows.size] = logits_rows


def fill_tables(host: StepFields[np.ndarray], key: GraphKey, tables: Sequence[Sequence[int]]) -> None:
    """A speculative step's host-side batch fields: its requests' page tables (``fill_batch``'s ``tables``),
    every row's logits, and R rows per sequence. The rest of its batch is derived on the device from the anchors
    (:func:`speculative_rows`), so the host need not know them: a step can be filled and launched before the
    one before it has been read."""
    b, r, p = key.num_seqs, key.rows_per_seq, key.pages
    host.cu_seqlens[:] = np.arange(b + 1) * r
    table = host.block_tables.reshape(b, p)
    table[:] = PAD_SLOT
    for i, pages in enumerate(tables):
        pages = np.asarray(pages, dtype=np.int64)
        table[i, :pages.size] = pages
    host.logits_rows[:] = np.arange(b * r)


def speculative_rows(fields: StepFields[Tensor], key: GraphKey, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(positions [B R], kv_slot_mapping [B R], context_lens [B])`` of a speculative step, on the device, from
    each request's anchor and page table: what ``fill_batch`` writes on the host for ``starts = anchors``. Request
    b's rows sit at ``anchors[b] + 0..R-1``; a row where its table has no page (past a request's pages: one near
    its end verifying fewer drafts) writes nothing; a padding request (state slot ``PAD_SLOT``) has positions 0,
    writes nothing and reads no context."""
    b, r, p = key.num_seqs, key.rows_per_seq, key.pages
    real = fields.state_slots >= 0  # [B]
    positions = torch.where(real[:, None], fields.anchors[:, None] + torch.arange(r, device=real.device), 0)
    tables = fields.block_tables.view(b, p)
    pages = tables.gather(1, torch.clamp(positions // page_size, max=p - 1))  # [B, R]
    held = real[:, None] & (pages >= 0) & (positions < p * page_size)
    kv_slots = torch.where(held, pages * page_size + positions % page_size, PAD_SLOT)
    context_lens = torch.where(real, torch.clamp(fields.anchors + r, max=p * page_size), 0)
    return positions.reshape(-1), kv_slots.reshape(-1), context_lens


def batch_view(fields: StepFields[Tensor], key: GraphKey, token_ids: Tensor,
               rows: tuple[Tensor, Tensor, Tensor] | None = None) -> ForwardBatch:
    """The ForwardBatch over the static fields (its int32 casts run inside the graph, so they replay too);
    ``rows``: the positions, K/V slots and context lengths when not fields (``speculative_rows``)."""
    positions, kv_slots, context_lens = rows or (fields.positions, fields.kv_slot_mapping, fields.context_lens)
    return ForwardBatch(
        token_ids=token_ids, positions=positions, cu_seqlens=fields.cu_seqlens.to(torch.int32),
        state_slots=fields.state_slots, kv_slot_mapping=kv_slots,
        block_tables=fields.block_tables.view(key.num_seqs, key.pages).to(torch.int32),
        context_lens=context_lens, is_verify=key.is_verify, logits_rows=fields.logits_rows,
        max_query_len=key.rows_per_seq)


def real_rows(batch: ForwardBatch, num_seqs: int, num_rows: int, num_logits: int) -> ForwardBatch:
    """The first ``num_seqs`` sequences (``num_rows`` rows) of a padded batch, as views."""
    return ForwardBatch(token_ids=batch.token_ids[:num_rows], positions=batch.positions[:num_rows],
                        cu_seqlens=batch.cu_seqlens[:num_seqs + 1], state_slots=batch.state_slots[:num_seqs],
                        kv_slot_mapping=batch.kv_slot_mapping[:num_rows], block_tables=batch.block_tables[:num_seqs],
                        context_lens=batch.context_lens[:num_seqs], is_verify=batch.is_verify,
                        logits_rows=batch.logits_rows[:num_logits], max_query_len=batch.max_query_len)
