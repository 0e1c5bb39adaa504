"""Batched target probabilities and keyed inverse-CDF draws, twin of ``reference/speculative/sampling.py``.

Per row b, with that row's temperature T, top_k, top_p (the reference's order of operations):

    x = logits / T                                  fp32
    p = softmax(x);  keep the top_k most likely (probability desc, id asc), then the smallest
        most-likely prefix whose renormalised mass reaches top_p (mass strictly before < top_p)
    target_probs = p * keep / sum(p * keep)
    token = smallest j with cumsum(target_probs)[j] > u * sum(target_probs)       (fp64)
    greedy rows (T = 0 or top_k = 1): argmax(logits), lowest id on ties

Two implementations:
- torch (``target_probs_torch``, ``sample_torch``): the reference's operations batched over rows,
  CPU or CUDA, no loop over rows.
- Triton (``target_probs_triton``, ``sample_triton``): the filter is a *cut* per row, found by
  torch's sort of every row (``filter_cuts``): token j survives iff (x_j, -j) >= (x_cut, -id_cut), i.e. it
  comes no later than the last kept token in (x desc, id asc) order, which is the reference's
  order because softmax is monotone. One program per row then makes three passes over V: max and
  argmax, the kept mass sum exp(x - max) (fp64), and either writes the probabilities or scans the
  kept weights for the keyed inverse-CDF draw, so a plain sample never materialises [B, V] probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose
from dflash2.reference.request.sampling_params import TOP_K_OFF, SamplingParams

from .philox import keyed_uniform_torch, philox_uniform, seeds_tensor
from .triton_compat import tl, triton, use_triton

@dataclass(frozen=True)
class SamplingTensors:
    """Per-request sampling parameters as device tensors  # each [B]."""

    temperature: Tensor  # fp32 (0: greedy)
    top_k: Tensor  # int64 (-1: off)
    top_p: Tensor  # fp32 in (0, 1]
    seeds: Tensor  # int64 holding the uint64 seed's bits

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   seeds_tensor([p.seed for p in params], device=device))

    @property
    def greedy(self) -> Tensor:
        return (self.temperature == 0) | (self.top_k == 1)  # [B] bool

    def repeat_rows(self, rows_per_request: int) -> SamplingTensors:
        """Each request's parameters for its ``rows_per_request`` consecutive rows  # [B * rows]."""
        return SamplingTensors(*(t.repeat_interleave(rows_per_request) for t in
                                 (self.temperature, self.top_k, self.top_p, self.seeds)))


def _scaled(logits: Tensor, st: SamplingTensors) -> Tensor:
    """x = logits / T in fp32, T = 1 on greedy rows (their x only feeds an argmax)  # [B, V]."""
    temperature = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)
    return logits.float() / temperature[:, None]


def _sorted_keep(probs: Tensor, st: SamplingTensors) -> tuple[Tensor, Tensor, Tensor]:
    """The reference's top-k/top-p keep mask in (probability desc, id asc) order.

    Returns the sorted probabilities, the order (token ids) and keep, each ``[B, V]``.
    """
    vocab = probs.shape[-1]
    neg_sorted, order = torch.sort(-probs, dim=-1, stable=True)
    sorted_probs = -neg_sorted
    rank = torch.arange(vocab, device=probs.device)
    keep = (st.top_k[:, None] == TOP_K_OFF) | (rank[None, :] < st.top_k[:, None])
    masked = sorted_probs * keep
    masked = masked / masked.sum(dim=-1, keepdim=True)
    mass_before = torch.cumsum(masked, dim=-1) - masked
    keep &= (mass_before < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0)
    return sorted_probs, order, keep


def target_probs_torch(logits: Tensor, st: SamplingTensors) -> Tensor:
    """The filtered target distribution of every row  # logits [B, V] -> [B, V] fp32."""
    probs = torch.softmax(_scaled(logits, st), dim=-1)
    sorted_probs, order, keep = _sorted_keep(probs, st)
    kept = torch.zeros_like(probs).scatter_(-1, order, torch.where(keep, sorted_probs, 0.0))
    kept = kept / kept.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(kept).scatter_(-1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
    return torch.where(st.greedy[:, None], one_hot, kept)


def draw_torch(weights: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draws in token-id order, as ``sampling.sample_from_probs`` per row.

    weights ``[B, V]`` (not necessarily normalised), u ``[B]`` in (0, 1). Returns ``[B]`` long.
    """
    cdf = torch.cumsum(weights.double(), dim=-1)  # [B, V]
    target = u.double() * cdf[:, -1]
    j = torch.searchsorted(cdf, target[:, None].contiguous(), right=True)[:, 0]
    vocab = weights.shape[-1]
    last = vocab - 1 - torch.argmax(torch.flip(weights > 0, dims=[-1]).to(torch.uint8), dim=-1)
    return torch.minimum(j, last)


def sample_torch(logits: Tensor, st: SamplingTensors, positions: Tensor, purpose: int = Purpose.SAMPLE,
                 slots: Tensor | int = 0) -> Tensor:
    """One keyed draw per row from its target distribution  # logits [B, V] -> tokens [B] long."""
    u = keyed_uniform_torch(st.seeds, positions, int(purpose), slots)
    return draw_torch(target_probs_torch(logits, st), u)


# -- Triton ---------------------------------------------------------------------------------------

def filter_cuts(logits: Tensor, st: SamplingTensors) -> tuple[Tensor, Tensor]:
    """Each row's last kept token in (x desc, id asc) order: its x and its id  # [B] fp32, [B] int64.

    Rows without a filter (and greedy rows) get (-inf, V-1), which keeps everything. Every row is
    sorted, so the launch sequence has no host synchronisation (CUDA-graph capturable).
    """
    vocab = logits.shape[-1]
    filtered = ~st.greedy & ((st.top_k != TOP_K_OFF) | (st.top_p < 1.0))
    x = _scaled(logits, st)
    _, order, keep = _sorted_keep(torch.softmax(x, dim=-1), st)
    last = keep.sum(dim=-1, keepdim=True) - 1  # kept sets are prefixes of the order
    cut_id = order.gather(-1, last)
    cut_x = x.gather(-1, cut_id)[:, 0]
    cut_id = cut_id[:, 0]
    return (torch.where(filtered, cut_x, float("-inf")),
            torch.where(filtered, cut_id, torch.full_like(cut_id, vocab - 1)))


@triton.jit
def row_stats(row_ptr, temperature, cut_x, cut_id, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    """(max x, argmax of x with the lowest id, kept mass sum exp(x - max) in fp64) of one row."""
    offs = tl.arange(0, BLOCK_V)
    best = -float("inf")
    best_id = tl.program_id(0) * 0
    for start in range(0, VOCAB, BLOCK_V):
        ids = start + offs
        x = tl.load(row_ptr + ids, mask=ids < VOCAB, other=-float("inf")).to(tl.float32)
        x = tl.math.div_rn(x, temperature)
        block_max = tl.max(x, axis=0)
        block_id = tl.min(tl.where(x == block_max, ids, VOCAB), axis=0)
        take = block_max > best
        best_id = tl.where(take, block_id, best_id)
        best = tl.where(take, block_max, best)
    mass = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, VOCAB, BLOCK_V):
        ids = start + offs
        x = tl.load(row_ptr + ids, mask=ids < VOCAB, other=-float("inf")).to(tl.float32)
        x = tl.math.div_rn(x, temperature)
        kept = (ids < VOCAB) & ((x > cut_x) | ((x == cut_x) & (ids <= cut_id)))
        mass += tl.where(kept, tl.exp(x - best), 0.0).to(tl.float64)
    return best, best_id, tl.sum(mass, axis=0)


@triton.jit
def kept_weight(row_ptr, ids, temperature, cut_x, cut_id, row_max, VOCAB: tl.constexpr):
    """exp(x - max) on kept tokens, 0 elsewhere, fp64  # ids [BLOCK_V]."""
    x = tl.load(row_ptr + ids, mask=ids < VOCAB, other=-float("inf")).to(tl.float32)
    x = tl.math.div_rn(x, temperature)
    kept = (ids < VOCAB) & ((x > cut_x) | ((x == cut_x) & (ids <= cut_id)))
    return tl.where(kept, tl.exp(x - row_max), 0.0).to(tl.float64)


@triton.jit
def _row_params(temperature_ptr, top_k_ptr, row):
    temperature = tl.load(temperature_ptr + row)
    greedy = (temperature == 0.0) | (tl.load(top_k_ptr + row) == 1)
    return tl.where(greedy, 1.0, temperature), greedy


@triton.jit
def _target_probs_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, cut_x_ptr, cut_id_ptr, out_ptr,
                         VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temperature, greedy = _row_params(temperature_ptr, top_k_ptr, row)
    cut_x, cut_id = tl.load(cut_x_ptr + row), tl.load(cut_id_ptr + row)
    row_max, argmax, mass = row_stats(row_ptr, temperature, cut_x, cut_id, VOCAB, BLOCK_V)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, VOCAB, BLOCK_V):
        ids = start + offs
        probs = (kept_weight(row_ptr, ids, temperature, cut_x, cut_id, row_max, VOCAB) / mass).to(tl.float32)
        probs = tl.where(greedy, tl.where(ids == argmax, 1.0, 0.0), probs)
        tl.store(out_ptr + row.to(tl.int64) * VOCAB + ids, probs, mask=ids < VOCAB)


@triton.jit
def _sample_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, cut_x_ptr, cut_id_ptr, seed_ptr,
                   position_ptr, slot_ptr, purpose, out_ptr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temperature, greedy = _row_params(temperature_ptr, top_k_ptr, row)
    cut_x, cut_id = tl.load(cut_x_ptr + row), tl.load(cut_id_ptr + row)
    row_max, argmax, mass = row_stats(row_ptr, temperature, cut_x, cut_id, VOCAB, BLOCK_V)
    u = philox_uniform(tl.load(seed_ptr + row), tl.load(position_ptr + row), purpose, tl.load(slot_ptr + row))
    target = u.to(tl.float64) * mass
    offs = tl.arange(0, BLOCK_V)
    cum = tl.zeros([1], dtype=tl.float64)
    pick = VOCAB + 0 * argmax
    last = -1 + 0 * argmax
    for start in range(0, VOCAB, BLOCK_V):
        ids = start + offs
        w = kept_weight(row_ptr, ids, temperature, cut_x, cut_id, row_max, VOCAB)
        cdf = tl.sum(cum) + tl.cumsum(w, axis=0)
        pick = tl.minimum(pick, tl.min(tl.where(cdf > target, ids, VOCAB), axis=0))
        last = tl.maximum(last, tl.max(tl.where(w > 0, ids, -1), axis=0))
        cum = cum + tl.sum(w, axis=0)
    tl.store(out_ptr + row, tl.where(greedy, argmax, tl.minimum(pick, last)))


def _block_v(vocab: int) -> int:
    return min(1024, triton.next_power_of_2(vocab))


def target_probs_triton(logits: Tensor, st: SamplingTensors) -> Tensor:
    """``target_probs_torch`` by the Triton kernel  # logits [B, V] -> [B, V] fp32."""
    rows, vocab = logits.shape
    cut_x, cut_id = filter_cuts(logits, st)
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _target_probs_kernel[(rows,)](logits, logits.stride(0), st.temperature, st.top_k, cut_x, cut_id, out,
                                      VOCAB=vocab, BLOCK_V=_block_v(vocab))
    return out


def sample_triton(logits: Tensor, st: SamplingTensors, positions: Tensor, purpose: int = Purpose.SAMPLE,
                  slots: Tensor | int = 0) -> Tensor:
    """``sample_torch`` by the fused Triton kernel  # logits [B, V] -> tokens [B] long."""
    rows, vocab = logits.shape
    cut_x, cut_id = filter_cuts(logits, st)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=logits.device).expand(rows).contiguous()
    slots = torch.as_tensor(slots, dtype=torch.int64, device=logits.device).expand(rows).contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _sample_kernel[(rows,)](logits, logits.stride(0), st.temperature, st.top_k, cut_x, cut_id, st.seeds,
                                positions, slots, int(purpose), out, VOCAB=vocab, BLOCK_V=_block_v(vocab))
    return out


def target_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """The engine's entry point: Triton on CUDA, torch elsewhere."""
    return target_probs_triton(logits, st) if use_triton(logits) else target_probs_torch(logits, st)


def sample(logits: Tensor, st: SamplingTensors, positions: Tensor, purpose: int = Purpose.SAMPLE,
           slots: Tensor | int = 0) -> Tensor:
    """The engine's entry point: Triton on CUDA, torch elsewhere."""
    if use_triton(logits):
        return sample_triton(logits, st, positions, purpose, slots)
    return sample_torch(logits, st, positions, purpose, slots)
