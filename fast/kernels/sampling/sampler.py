"""Batched target probabilities and keyed inverse-CDF draws, twin of ``reference/speculative/sampling.py``.

Per row b, with that row's temperature T, top_k, top_p (the reference's order of operations; the
filter itself, and why its decisions are taken in fp64, is ``row_filter``'s docstring):

    x = fl32(logits / T);  w_j = exp(x_j - max x) in fp64 on the kept set (top-k, then top-p
        over the renormalised mass), 0 elsewhere;  Z = sum_j w_j
    target_probs = fl32(w / Z)
    token = smallest j with cumsum(w)[j] > u * Z (fp64), never past the last kept token
    greedy rows (T = 0 or top_k = 1): argmax(logits), lowest id on ties

Two implementations:
- torch (``target_probs_torch``, ``sample_torch``): a sort of every row (``row_filter.kept_weights_torch``),
  batched over rows, CPU or CUDA.
- Triton (``target_probs_triton``, ``sample_triton``): ``row_filter.filter_triton`` finds each row's cut
  without sorting, then one pass over (row, chunk) programs writes the probabilities, or sums the
  kept weight of each chunk; the row's last program picks the chunk where u * Z falls and scans that
  chunk alone for the token (``_draw_kernel``, shared with the verifier's final draw). No launch
  waits on the host (CUDA-graph capturable).

In both, a batch the host knows is all greedy (``SamplingTensors.all_greedy``) is one argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose
from dflash2.reference.request.sampling_params import TOP_K_OFF, SamplingParams

from .philox import keyed_uniform_torch, philox_uniform, seeds_tensor
from .row_filter import (DEFAULT_CONFIG, FilterConfig, Layout, RowFilter, filter_triton, kept_mask,
                         kept_weights_torch, row_params)
from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton


@dataclass(frozen=True)
class HostSummary:
    """What the host knows of a batch's parameters without reading the device: which kernels may have
    work. Each flag may only err towards True (a summary of a larger batch is valid for any part of it)."""

    any_sampled: bool  # a row that is not greedy
    any_filtered: bool  # a sampled row with top_k > 1 or top_p < 1
    any_top_p_only: bool  # a sampled row with top_k off and top_p < 1
    max_top_k: int  # the largest top_k of a sampled row (-1: none)

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> HostSummary:
        sampled = [p for p in params if not p.greedy]
        return cls(bool(sampled), any(p.top_k != TOP_K_OFF or p.top_p < 1.0 for p in sampled),
                   any(p.top_k == TOP_K_OFF and p.top_p < 1.0 for p in sampled),
                   max((p.top_k for p in sampled), default=TOP_K_OFF))


@dataclass(frozen=True)
class SamplingTensors:
    """Per-request sampling parameters as device tensors  # each [B]."""

    temperature: Tensor  # fp32 (0: greedy)
    top_k: Tensor  # int64 (-1: off)
    top_p: Tensor  # fp32 in (0, 1]
    seeds: Tensor  # int64 holding the uint64 seed's bits
    host: HostSummary | None = None  # None: unknown (every kernel is launched; results are the same)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   seeds_tensor([p.seed for p in params], device=device), HostSummary.of(params))

    @property
    def greedy(self) -> Tensor:
        return (self.temperature == 0) | (self.top_k == 1)  # [B] bool

    @property
    def all_greedy(self) -> bool:
        """True only when the host knows every request is greedy."""
        return self.host is not None and not self.host.any_sampled

    def select(self, index: Tensor | slice) -> SamplingTensors:
        """The parameters of the requests at ``index`` (the host summary stays valid)."""
        return SamplingTensors(self.temperature[index], self.top_k[index], self.top_p[index], self.seeds[index],
                               self.host)

    def repeat_rows(self, rows_per_request: int) -> SamplingTensors:
        """Each request's parameters for its ``rows_per_request`` consecutive rows  # [B * rows]."""
        return SamplingTensors(*(t.repeat_interleave(rows_per_request) for t in
                                 (self.temperature, self.top_k, self.top_p, self.seeds)), self.host)


def target_probs_torch(logits: Tensor, st: SamplingTensors) -> Tensor:
    """The filtered target distribution of every row  # logits [B, V] -> [B, V] fp32."""
    _, w = kept_weights_torch(logits, st)
    return (w / w.sum(dim=-1, keepdim=True)).float()


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
    if st.all_greedy:  # the host knows every row is greedy: its draw is the argmax (as sample_triton)
        return torch.argmax(logits, dim=-1)
    u = keyed_uniform_torch(st.seeds, positions, int(purpose), slots)
    return draw_torch(kept_weights_torch(logits, st)[1], u)


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit
def kept_weight(row_ptr, ids, temperature, cut_x, cut_id, m64, VOCAB: tl.constexpr):
    """w on the kept tokens among ``ids``, 0 elsewhere (fp64); a block with none skips the exponentials."""
    valid = ids < VOCAB
    x = tl.math.div_rn(tl.load(row_ptr + ids, mask=valid, other=-float("inf")).to(tl.float32), temperature)
    kept = kept_mask(x, ids, cut_x, cut_id, valid)
    w = tl.zeros(ids.shape, dtype=tl.float64)
    if tl.max(kept.to(tl.int32), axis=0) > 0:
        w = tl.where(kept, tl.exp(x.to(tl.float64) - m64), 0.0)
    return w


@triton.jit
def _residual(w, ids, z, cand_ptr, dprobs_ptr, qbase, inv_total, KSEL: tl.constexpr):
    """max(0, w / z - q) with q the scatter-add of the normalised draft row over its candidates."""
    q = tl.zeros(ids.shape, dtype=tl.float64)
    for j in tl.static_range(KSEL):
        cid = tl.load(cand_ptr + qbase + j)
        q += tl.where(ids == cid, tl.load(dprobs_ptr + qbase + j).to(tl.float64) * inv_total, 0.0)
    return tl.maximum(w / z - q, 0.0)


@triton.jit
def _draw_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, m_ptr, argmax_ptr,
                 cut_x_ptr, cut_id_ptr, z_ptr, z_stride, position_ptr, slot_ptr, purpose, draw_row_ptr, use_q_ptr,
                 u_ptr, draw_slot_ptr, out_index_ptr, cand_ptr, dprobs_ptr, part_ptr, arrivals_ptr, out_ptr,
                 VERIFY: tl.constexpr, K: tl.constexpr, KSEL: tl.constexpr, KSEL_PAD: tl.constexpr,
                 VOCAB: tl.constexpr, BLOCK_V: tl.constexpr, BPC: tl.constexpr, NCHUNK: tl.constexpr,
                 NCHUNK_PAD: tl.constexpr):
    """Draw d: the inverse-CDF token of row ``draw_row[d]`` (verify) or row d (sample).

    Weights: w, or the residual max(0, w / z - q) where ``use_q[d]`` and it has mass. Each (d, chunk)
    program sums its chunk; the last one finds the chunk holding u * total and scans it.
    """
    d = tl.program_id(0)  # the request (verify) or the row (sample): its parameters either way
    chunk = tl.program_id(1)
    if VERIFY:
        row = tl.load(draw_row_ptr + d)
        use_q = tl.load(use_q_ptr + d) != 0
        qbase = (d * K + tl.load(draw_slot_ptr + d)) * KSEL
    else:
        row = d.to(tl.int64)
        use_q = d < 0
        qbase = d * 0
    temperature, greedy, k_on, p_on, top_k, top_p = row_params(temperature_ptr, top_k_ptr, top_p_ptr, d, VOCAB)
    if not VERIFY:
        if (greedy != 0) & (chunk == 0):
            tl.store(out_ptr + d, tl.load(argmax_ptr + row))
    if (row >= 0) & (greedy == 0):
        row_ptr = logits_ptr + row * stride_row
        m64 = tl.load(m_ptr + row).to(tl.float64)
        cut_x = tl.load(cut_x_ptr + row)
        cut_id = tl.load(cut_id_ptr + row)
        z = tl.load(z_ptr + row * z_stride)
        inv_total = 1.0
        if VERIFY:
            kidx = tl.arange(0, KSEL_PAD)
            inv_total = 1.0 / tl.sum(tl.load(dprobs_ptr + qbase + kidx, mask=kidx < KSEL, other=0.0).to(tl.float64),
                                     axis=0)
        offs = tl.arange(0, BLOCK_V)
        sum_p = z * 0.0
        sum_r = z * 0.0
        for b in range(BPC):
            ids = (chunk * BPC + b) * BLOCK_V + offs
            w = kept_weight(row_ptr, ids, temperature, cut_x, cut_id, m64, VOCAB)
            sum_p += tl.sum(w, axis=0)
            if VERIFY:
                if use_q:
                    sum_r += tl.sum(_residual(w, ids, z, cand_ptr, dprobs_ptr, qbase, inv_total, KSEL), axis=0)
        tl.store(part_ptr + (d * NCHUNK + chunk) * 2, sum_p)
        tl.store(part_ptr + (d * NCHUNK + chunk) * 2 + 1, sum_r)
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + d, 1) == NCHUNK - 1:
            tl.store(arrivals_ptr + d, 0)
            cidx = tl.arange(0, NCHUNK_PAD)
            in_row = cidx < NCHUNK
            parts_p = tl.load(part_ptr + (d * NCHUNK + cidx) * 2, mask=in_row, other=0.0, volatile=True)
            parts_r = tl.load(part_ptr + (d * NCHUNK + cidx) * 2 + 1, mask=in_row, other=0.0, volatile=True)
            cdf_r = tl.cumsum(parts_r, axis=0)
            use_r = use_q & (tl.max(cdf_r, axis=0) > 0.0)
            parts = tl.where(use_r, parts_r, parts_p)
            cdf = tl.where(use_r, cdf_r, tl.cumsum(parts_p, axis=0))
            if VERIFY:
                u = tl.load(u_ptr + d)
                out = tl.load(out_index_ptr + d)
            else:
                u = philox_uniform(tl.load(seed_ptr + d), tl.load(position_ptr + d), purpose,
                                   tl.load(slot_ptr + d)).to(tl.float64)
                out = d.to(tl.int64)
            target = u * tl.max(cdf, axis=0)
            # the chunk where the CDF first passes the target; the last chunk with mass guards u * total == total
            c = tl.sum((in_row & (cdf <= target)).to(tl.int32), axis=0)
            last_chunk = tl.max(tl.where(in_row & (parts > 0.0), cidx, -1), axis=0)
            c = tl.where((c < NCHUNK) & (tl.sum(tl.where(cidx == c, parts, 0.0), axis=0) > 0.0), c, last_chunk)
            c = tl.maximum(c, 0)  # the kept set is never empty: its first token has w = 1
            running = tl.sum(tl.where(cidx == c - 1, cdf, 0.0), axis=0)
            pick = c * 0 + VOCAB
            last = c * 0 - 1
            for b in range(BPC):
                ids = (c * BPC + b) * BLOCK_V + offs
                w = kept_weight(row_ptr, ids, temperature, cut_x, cut_id, m64, VOCAB)
                if use_r:
                    w = _residual(w, ids, z, cand_ptr, dprobs_ptr, qbase, inv_total, KSEL)
                cum = running + tl.cumsum(w, axis=0)
                pick = tl.minimum(pick, tl.min(tl.where(cum > target, ids, VOCAB), axis=0))
                last = tl.maximum(last, tl.max(tl.where(w > 0.0, ids, -1), axis=0))
                running += tl.sum(w, axis=0)
            tl.store(out_ptr + out, tl.where(pick < VOCAB, pick, last).to(tl.int64))


@triton.jit
def _target_probs_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, m_ptr, argmax_ptr,
                         cut_x_ptr, cut_id_ptr, z_ptr, z_stride, out_ptr, VOCAB: tl.constexpr,
                         BLOCK_V: tl.constexpr, BPC: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature, greedy, k_on, p_on, top_k, top_p = row_params(temperature_ptr, top_k_ptr, top_p_ptr, row, VOCAB)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    m64 = tl.load(m_ptr + row).to(tl.float64)
    cut_x = tl.load(cut_x_ptr + row)
    cut_id = tl.load(cut_id_ptr + row)
    z = tl.load(z_ptr + row * z_stride)
    argmax = tl.load(argmax_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    for b in range(BPC):
        ids = (chunk * BPC + b) * BLOCK_V + offs
        if greedy != 0:
            probs = tl.where(ids == argmax, 1.0, 0.0)
        else:
            probs = (kept_weight(row_ptr, ids, temperature, cut_x, cut_id, m64, VOCAB) / z).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * VOCAB + ids, probs, mask=ids < VOCAB)


def _contiguous_rows(logits: Tensor) -> Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _per_row(value: Tensor | int, rows: int, device: torch.device) -> Tensor:
    """An int64 [rows] tensor of a tensor or an int (filled on the device: no copy from the host)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.int64).expand(rows).contiguous()
    return torch.full((rows,), int(value), dtype=torch.int64, device=device)


@dataclass(frozen=True)
class VerifyDraws:
    """What the verifier's walk leaves to the final draw of each request  # each [B] unless noted."""

    draw_row: Tensor  # int64: the flat logits row to draw from (-1: a greedy request, its token written)
    use_q: Tensor  # int32: draw from the residual max(0, p - q) where it has mass
    u: Tensor  # fp64: residual_u after a rejection, bonus_u after k acceptances
    slot: Tensor  # int64: the slot whose q row the residual subtracts
    out_index: Tensor  # int64: where the token goes in the flat emitted [B * (k+1)]
    cand_ids: Tensor  # [B, k, K] int64
    draft_probs: Tensor  # [B, k, K]


def launch_draws(logits: Tensor, st: SamplingTensors, flt: RowFilter, layout: Layout, out: Tensor, *,
                 positions: Tensor | None = None, slots: Tensor | None = None, purpose: int = 0,
                 verify: VerifyDraws | None = None) -> None:
    """``_draw_kernel`` over (draw, chunk): one draw per row keyed (seed, position, purpose, slot) into
    ``out [R]`` (sample), or one per request as the verifier's walk left it (``verify``)."""
    draws = logits.shape[0] if verify is None else verify.draw_row.shape[0]
    device = logits.device
    parts = torch.empty((draws, layout.num_chunks, 2), dtype=torch.float64, device=device)
    arrivals = torch.zeros(draws, dtype=torch.int32, device=device)
    if verify is None:
        unused = flt.argmax
        mode = (positions, slots, unused, unused, unused, unused, unused, unused, unused)
        k, ksel = 1, 1
    else:
        unused = verify.draw_row
        mode = (unused, unused, verify.draw_row, verify.use_q, verify.u, verify.slot, verify.out_index,
                verify.cand_ids, verify.draft_probs)
        k, ksel = verify.cand_ids.shape[1:]
    _draw_kernel[(draws, layout.num_chunks)](
        logits, logits.stride(0), st.temperature, st.top_k, st.top_p, st.seeds, flt.row_max, flt.argmax, flt.cut_x,
        flt.cut_id, flt.z_kept, flt.z_kept.stride(0), mode[0], mode[1], int(purpose), *mode[2:], parts, arrivals, out,
        VERIFY=verify is not None, K=k, KSEL=ksel, KSEL_PAD=max(2, triton.next_power_of_2(ksel)),
        VOCAB=logits.shape[1], BLOCK_V=layout.block_v, BPC=layout.blocks_per_chunk, NCHUNK=layout.num_chunks,
        NCHUNK_PAD=layout.num_chunks_pad)


def target_probs_triton(logits: Tensor, st: SamplingTensors, config: FilterConfig = DEFAULT_CONFIG) -> Tensor:
    """``target_probs_torch`` by the Triton kernels  # logits [B, V] -> [B, V] fp32."""
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows:
        logits = _contiguous_rows(logits)
        flt = filter_triton(logits, st, config=config)
        layout = Layout.of(vocab, config)
        _target_probs_kernel[(rows, layout.num_chunks)](
            logits, logits.stride(0), st.temperature, st.top_k, st.top_p, flt.row_max, flt.argmax, flt.cut_x,
            flt.cut_id, flt.z_kept, flt.z_kept.stride(0), out, VOCAB=vocab, BLOCK_V=layout.block_v,
            BPC=layout.blocks_per_chunk)
    return out


def sample_triton(logits: Tensor, st: SamplingTensors, positions: Tensor, purpose: int = Purpose.SAMPLE,
                  slots: Tensor | int = 0, config: FilterConfig = DEFAULT_CONFIG) -> Tensor:
    """``sample_torch`` by the Triton kernels  # logits [B, V] -> tokens [B] long."""
    rows, vocab = logits.shape
    if st.all_greedy:
        return torch.argmax(logits, dim=-1)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        logits = _contiguous_rows(logits)
        positions, slots = (_per_row(v, rows, logits.device) for v in (positions, slots))
        flt = filter_triton(logits, st, config=config)
        launch_draws(logits, st, flt, Layout.of(vocab, config), out, positions=positions, slots=slots,
                     purpose=purpose)
    return out


target_probs = KernelOp("target_probs", target_probs_torch, GpuForm(target_probs_triton))
sample = KernelOp("sample", sample_torch, GpuForm(sample_triton))
