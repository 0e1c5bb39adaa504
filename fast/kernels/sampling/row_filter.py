"""The top-k/top-p filter of every row without sorting a vocabulary row: the kept set as one cut.

Per sampled row (temperature T, top_k, top_p; greedy rows need only the argmax):

    x_j = fl32(logit_j / T),   m = max_j x_j,   w_j = exp(x_j - m)  in fp64
    order: x descending, id ascending (softmax is monotone, so this is the reference's
           probability order; -0.0 and 0.0 are one value)
    top-k: the first top_k tokens of the order (off when top_k = -1 or top_k >= V)
    top-p: of those, token j is kept iff the weight strictly before it in the order is
           < top_p * Z_k, Z_k = sum of w over the top-k set (off when top_p = 1)

The kept set is a prefix of the order, so it is one cut: token j is kept iff
(x_j, -j) >= (cut_x, -cut_id), and ``z_kept`` is its weight. The decisions are made in fp64,
where the reference renormalises and sums in fp32: the two differ only when the mass before a
token lies within ~1e-6 of top_p (a top-p near tie, docs/tolerances.md). fp64 sums taken in
different orders differ by ~1e-16 relative, so this module and its torch twin agree exactly
except at ties that close.

Order keys: ``key = (ord(x) << 31) | (2^31 - 1 - id)``, ord the fp32 bits mapped so that they
increase with x, is an int64 that orders tokens exactly as above and is unique per token.

The kernels (each launched over (row, chunk) programs; the last program of a row to finish,
counted by an atomic, combines the row's partials, so no pass waits on the host):

1. ``_stats_kernel``: one pass: max, argmax (lowest id) and the max of every block of
   ``block_v`` logits. The row's candidate threshold t is the c-th largest block max
   (c = min(top_k, blocks) for a top-k row): at least c tokens lie at or above it, so for
   c = top_k every token of the top-k set does.
2. ``_select_kernel`` step 0: one pass collecting the keys of the tokens with x >= t (at most
   ``cap`` of them) and, for rows with top-k off, Z = sum of w over the row. The last program
   ranks the candidates without sorting (for each, the count and weight of the candidates at or
   above it) and finds the cut among them: the top_k-th, then top-p inside. That resolves every
   top-k row whose ties fit in the buffer, and top-p rows whose kept mass lies above t.
3. Rows left over (top-k off with the kept set reaching below t, top_k above the block count,
   or more than ``cap`` candidates) are narrowed by bisection over the key range: each round
   counts, and weighs in fp64, the tokens at or above ``thresholds`` evenly spaced keys in the
   current bracket and keeps the sub-range where the count (top-k) or mass (top-p) reaches its
   target, until the bracket holds at most ``cap`` tokens; those are collected and resolved as
   in step 0, with the count and mass above the bracket added. ``rounds`` such steps run over
   (row, chunk) programs when top-p-only rows may need them; ``_select_finish_kernel`` (one
   program per row, looping) finishes any row still open, so the result is exact for every
   input; only its speed depends on the data.

Everything is fixed-shape and free of host synchronisation (CUDA-graph capturable); which
launches run depends only on the host's summary of the batch's parameters, not on the data.
Bounds: memory (one read of the logits for stats, one for step 0; top-k rows skip the fp64
exponentials outside their candidates); bisection rounds add a read each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..common.triton_compat import tl, triton

_RID = tl.constexpr(2**31 - 1)
# the key of +inf at id 0, the largest key of a NaN-free row; small enough that key + thresholds fits in int64
_KEY_MAX = tl.constexpr(((0xFF800000) << 31) | (2**31 - 1))
_ISTATE = tl.constexpr(7)  # phase, zflag, lo, hi, count above hi, the row's lowest and highest keys
_FSTATE = tl.constexpr(3)  # mass above hi, mass target, z_kept
# per (row, chunk) partials, int64 [3 * NT + 2]: counts at or above each threshold key, the least key at or
# above it, the greatest below it (bisect); the count above hi (collect); the greatest key in the bracket
# (bisect). fp64 [NT + 3]: masses at or above each threshold (bisect); mass above hi, mass in the bracket,
# Z (collect).

# phases of a row's selection
_DONE, _COUNT_ROUNDS, _COUNT_COLLECT, _MASS_ROUNDS, _MASS_COLLECT = (tl.constexpr(i) for i in range(5))


@dataclass(frozen=True)
class FilterConfig:
    """Launch shape of the filter kernels (any values give the same result)."""

    block_v: int = 1024  # logits per block: one block max each, the unit a program loads
    blocks_per_chunk: int = 4  # blocks per (row, chunk) program
    cap: int = 256  # candidates a row may collect (power of 2)
    thresholds: int = 32  # keys per bisection round (power of 2)
    block_r: int = 32  # logits per bisection tile (divides block_v)
    rounds: int = 5  # chunked bisection steps launched when top-p-only rows may need them
    min_chunks: int = 32  # (row, chunk) programs per row the layout keeps where the vocabulary allows

    def __post_init__(self) -> None:
        for name in ("block_v", "cap", "thresholds", "block_r"):
            value = getattr(self, name)
            if value < 2 or value & (value - 1):
                raise ValueError(f"FilterConfig.{name}={value}: expected a power of 2 >= 2")
        if self.block_v % self.block_r:
            raise ValueError(f"FilterConfig.block_r={self.block_r}: expected a divisor of block_v={self.block_v}")
        if self.blocks_per_chunk < 1 or self.rounds < 0 or self.min_chunks < 1:
            raise ValueError(f"FilterConfig {self}: expected blocks_per_chunk >= 1, rounds >= 0 and min_chunks >= 1")

    @property
    def finisher_iters(self) -> int:
        """A bound on the steps any row takes: a round leaves a bracket of W keys at most W / thresholds + 1
        wide, so r rounds bring 2^63 keys to ``cap``; a row has step 0 and at most two phases of r rounds
        and a collect (the loop ends as soon as the row is done; the margin covers a 1e-16 disagreement
        between a round's sums and the collect's sending a row back once)."""
        rounds = -(-(63 - self.cap.bit_length() + 1) // (self.thresholds.bit_length() - 1))
        return 3 * (rounds + 1) + 1


DEFAULT_CONFIG = FilterConfig()


@dataclass(frozen=True)
class Layout:
    """How a row of V logits is cut into blocks and chunks (blocks shrink to fit a small V)."""

    vocab: int
    block_v: int
    block_r: int
    num_blocks: int
    blocks_per_chunk: int
    num_chunks: int

    @classmethod
    def of(cls, vocab: int, cfg: FilterConfig) -> Layout:
        """A row spreads over at least ``min_chunks`` programs where it can: each program walks its chunk
        alone, so a small vocabulary in a few large chunks is latency-bound (one row of 8,256 logits in 3
        chunks of 4,096 took 5x longer than in 33 of 256). Blocks halve (not below 128 logits, nor below
        ``block_r``) until the row has ``min_chunks`` of them, then chunks take only as many blocks as
        keep ``min_chunks`` chunks."""
        block_v = min(cfg.block_v, max(16, triton.next_power_of_2(vocab)))
        floor = max(128, cfg.block_r)
        while block_v // 2 >= floor and triton.cdiv(vocab, block_v) < cfg.min_chunks:
            block_v //= 2
        blocks = triton.cdiv(vocab, block_v)
        per_chunk = max(1, min(cfg.blocks_per_chunk, blocks // cfg.min_chunks, blocks))
        return cls(vocab, block_v, min(cfg.block_r, block_v), blocks, per_chunk, triton.cdiv(blocks, per_chunk))

    @property
    def num_chunks_pad(self) -> int:
        return max(2, triton.next_power_of_2(self.num_chunks))


@dataclass(frozen=True)
class RowFilter:
    """Per-row results  # each [R]."""

    row_max: Tensor  # fp32, m
    argmax: Tensor  # int64, lowest id on ties
    cut_x: Tensor  # fp32 } kept iff (x, -id) >= (cut_x, -cut_id); (-inf, V-1) keeps every token
    cut_id: Tensor  # int64 }
    z_kept: Tensor  # fp64, sum of w over the kept tokens (sampled rows)


# -- torch twin -----------------------------------------------------------------------------------

def per_row(st, rows_per_request: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """(temperature, top_k, top_p) of every row  # [R] each."""
    params = (st.temperature, st.top_k, st.top_p)
    return tuple(t.repeat_interleave(rows_per_request) for t in params) if rows_per_request > 1 else params


def scaled_logits(logits: Tensor, st, rows_per_request: int = 1) -> tuple[Tensor, Tensor]:
    """(x = fl32(logits / T) with T = 1 on greedy rows, whose x only feeds an argmax; greedy)  # [R, V], [R]."""
    temperature, top_k, _ = per_row(st, rows_per_request)
    greedy = (temperature == 0) | (top_k == 1)
    return logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None], greedy


def kept_weights_torch(logits: Tensor, st, rows_per_request: int = 1) -> tuple[Tensor, Tensor]:
    """The filter by a sort of every row: (kept [R, V] bool, w [R, V] fp64, 0 off the kept set).

    Greedy rows keep their argmax alone, with weight 1.
    """
    x, greedy = scaled_logits(logits, st, rows_per_request)
    vocab = x.shape[-1]
    _, top_k, top_p = per_row(st, rows_per_request)
    k_on = ~greedy & (top_k > 1) & (top_k < vocab)
    p_on = ~greedy & (top_p < 1.0)
    w = torch.exp(x.double() - x.max(dim=-1, keepdim=True).values.double())
    order = torch.sort(-x, dim=-1, stable=True).indices  # x desc, id asc
    w_sorted = w.gather(-1, order)
    rank = torch.arange(vocab, device=x.device)
    in_k = ~k_on[:, None] | (rank[None, :] < top_k[:, None])
    masked = torch.where(in_k, w_sorted, 0.0)
    before = torch.cumsum(masked, dim=-1) - masked
    goal = top_p.double()[:, None] * masked.sum(dim=-1, keepdim=True)
    keep_sorted = in_k & (~p_on[:, None] | (before < goal))
    kept = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    one_hot = torch.zeros_like(kept).scatter_(-1, torch.argmax(x, dim=-1, keepdim=True), True)
    kept = torch.where(greedy[:, None], one_hot, kept)
    return kept, torch.where(kept, torch.where(greedy[:, None], 1.0, w), 0.0)


def filter_torch(logits: Tensor, st, rows_per_request: int = 1) -> RowFilter:
    """``filter_triton``'s results from ``kept_weights_torch``: the cut is the last kept token of the order."""
    x, _ = scaled_logits(logits, st, rows_per_request)
    kept, w = kept_weights_torch(logits, st, rows_per_request)
    order = torch.sort(-x, dim=-1, stable=True).indices
    cut_id = order.gather(-1, kept.gather(-1, order).sum(dim=-1, keepdim=True) - 1)
    return RowFilter(x.max(dim=-1).values, torch.argmax(x, dim=-1), x.gather(-1, cut_id)[:, 0], cut_id[:, 0],
                     w.sum(dim=-1))


def kept_by_cut(x: Tensor, cut_x: Tensor, cut_id: Tensor) -> Tensor:
    """The kept set a cut describes  # x [R, V], cuts [R] -> [R, V] bool."""
    ids = torch.arange(x.shape[-1], device=x.device)
    return (x > cut_x[:, None]) | ((x == cut_x[:, None]) & (ids[None, :] <= cut_id[:, None]))


# -- Triton device functions ------------------------------------------------------------------------

@triton.jit
def row_params(temperature_ptr, top_k_ptr, top_p_ptr, req, VOCAB: tl.constexpr):
    """(T to divide by, greedy, top-k on, top-p on, top_k, top_p) of request ``req``."""
    temperature = tl.load(temperature_ptr + req)
    top_k = tl.load(top_k_ptr + req)
    top_p = tl.load(top_p_ptr + req)
    greedy = (temperature == 0.0) | (top_k == 1)
    k_on = (top_k > 1) & (top_k < VOCAB) & (greedy == 0)
    p_on = (top_p < 1.0) & (greedy == 0)
    return tl.where(greedy, 1.0, temperature), greedy, k_on, p_on, top_k, top_p


@triton.jit
def order_key(x, ids):
    """int64 keys ordering tokens by (x desc, id asc): a larger key comes earlier."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and 0.0 are one value
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    ordered = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    return (ordered << 31) | (_RID - ids.to(tl.int64))


@triton.jit
def key_x(key):
    ordered = key >> 31
    bits = tl.where(ordered >= 0x80000000, ordered - 0x80000000, 0xFFFFFFFF - ordered)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def key_id(key):
    return _RID - (key & _RID)


@triton.jit
def kept_mask(x, ids, cut_x, cut_id, valid):
    return valid & ((x > cut_x) | ((x == cut_x) & (ids <= cut_id)))


@triton.jit
def _pick(values, idx, at):
    """values[at] for a runtime scalar ``at`` (0 when out of range)."""
    return tl.sum(tl.where(idx == at, values, 0), axis=0)


@triton.jit
def _rank_cut(keys_ptr, n_col, m64, floor_key, goal, count_mode, n_above, s_above, CAP: tl.constexpr,
              TILE: tl.constexpr):
    """The cut among ``n_col`` collected keys (those >= floor_key), ranked without sorting.

    A key's reach is n_above plus the number of collected keys at or above it (count_mode), or
    s_above plus their weight: the count or mass up to and including it in the order. Reach grows
    along the order, and the cut is the first key (the largest) whose reach meets the goal: every
    token before it has less than the goal before it, and it is the last such token. Returns (cut
    key, its reach in mass). No key meeting the goal (two sums of one set disagreeing by ~1e-16)
    keeps every collected key.
    """
    best = floor_key * 0 - 1
    best_mass = s_above * 0.0
    least = floor_key * 0 + _KEY_MAX
    least_mass = s_above * 0.0
    for i in range(CAP // TILE):
        if i * TILE < n_col:
            iidx = i * TILE + tl.arange(0, TILE)
            keys = tl.load(keys_ptr + iidx, mask=iidx < n_col, other=-1, volatile=True)
            mine = (iidx < n_col) & (keys >= floor_key)
            count = tl.zeros([TILE], dtype=tl.int64)
            mass = tl.zeros([TILE], dtype=tl.float64)
            for j in range(CAP // TILE):
                if j * TILE < n_col:
                    jidx = j * TILE + tl.arange(0, TILE)
                    other = tl.load(keys_ptr + jidx, mask=jidx < n_col, other=-1, volatile=True)
                    w = tl.where(jidx < n_col, tl.exp(key_x(other).to(tl.float64) - m64), 0.0)
                    ge = (other[None, :] >= keys[:, None]) & (jidx < n_col)[None, :]
                    count += tl.sum(ge.to(tl.int64), axis=1)
                    mass += tl.sum(tl.where(ge, w[None, :], 0.0), axis=1)
            reach = tl.where(count_mode, (n_above + count).to(tl.float64), s_above + mass)
            here = tl.max(tl.where(mine & (reach >= goal), keys, -1), axis=0)
            here_mass = tl.sum(tl.where(mine & (keys == here), mass, 0.0), axis=0)
            best_mass = tl.where(here > best, here_mass, best_mass)
            best = tl.maximum(best, here)
            low = tl.min(tl.where(mine, keys, _KEY_MAX), axis=0)
            low_mass = tl.sum(tl.where(mine & (keys == low), mass, 0.0), axis=0)
            least_mass = tl.where(low < least, low_mass, least_mass)
            least = tl.minimum(least, low)
    found = best >= 0
    return tl.where(found, best, least), s_above + tl.where(found, best_mass, least_mass)


# -- pass 1: max, argmax, block maxima, the candidate threshold ----------------------------------------

@triton.jit
def _stats_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, bmax_ptr, cmax_ptr, cmin_ptr, carg_ptr,
                  arrivals_ptr, m_ptr, argmax_ptr, istate_ptr, cut_x_ptr, cut_id_ptr, fstate_ptr,
                  ROWS_PER_REQ: tl.constexpr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr, BPC: tl.constexpr,
                  NCHUNK: tl.constexpr, NCHUNK_PAD: tl.constexpr, NBLK: tl.constexpr, NBLK_PAD: tl.constexpr,
                  CAND_P: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature, greedy, k_on, p_on, top_k, top_p = row_params(temperature_ptr, top_k_ptr, top_p_ptr,
                                                               row // ROWS_PER_REQ, VOCAB)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK_V)
    # per-lane running max (earliest id on ties: ids grow across blocks) and min; one reduction per block
    lane_max = tl.full([BLOCK_V], -float("inf"), tl.float32)
    lane_id = offs
    lane_min = tl.full([BLOCK_V], float("inf"), tl.float32)
    for b in range(BPC):
        blk = chunk * BPC + b
        ids = blk * BLOCK_V + offs
        valid = ids < VOCAB
        x = tl.math.div_rn(tl.load(row_ptr + ids, mask=valid, other=-float("inf")).to(tl.float32), temperature)
        tl.store(bmax_ptr + row * NBLK + blk, tl.max(x, axis=0), mask=blk < NBLK)
        take = x > lane_max
        lane_id = tl.where(take, ids, lane_id)
        lane_max = tl.where(take, x, lane_max)
        lane_min = tl.minimum(lane_min, tl.where(valid, x, float("inf")))
    best = tl.max(lane_max, axis=0)
    # an all -inf chunk reports lane ids 0..BLOCK_V-1: it loses to any finite chunk, and an all -inf
    # row's argmax comes out 0, torch's choice
    best_id = tl.min(tl.where(lane_max == best, lane_id, VOCAB), axis=0)
    least = tl.min(lane_min, axis=0)
    tl.store(cmin_ptr + row * NCHUNK + chunk, least)
    tl.store(cmax_ptr + row * NCHUNK + chunk, best)
    tl.store(carg_ptr + row * NCHUNK + chunk, best_id)
    tl.debug_barrier()  # every thread's partials are stored before the release below
    if tl.atomic_add(arrivals_ptr + row, 1) == NCHUNK - 1:
        tl.store(arrivals_ptr + row, 0)
        cidx = tl.arange(0, NCHUNK_PAD)
        cmax = tl.load(cmax_ptr + row * NCHUNK + cidx, mask=cidx < NCHUNK, other=-float("inf"), volatile=True)
        carg = tl.load(carg_ptr + row * NCHUNK + cidx, mask=cidx < NCHUNK, other=VOCAB, volatile=True)
        m = tl.max(cmax, axis=0)
        argmax = tl.min(tl.where((cidx < NCHUNK) & (cmax == m), carg, VOCAB), axis=0)
        # an all -inf row: torch's argmax is 0
        argmax = tl.where(argmax == VOCAB, 0, argmax).to(tl.int64)
        tl.store(m_ptr + row, m)
        tl.store(argmax_ptr + row, argmax)
        # t = the c-th largest block max: the largest block max with at least c block maxima >= it
        c = tl.where(k_on, tl.minimum(top_k, NBLK), CAND_P)
        bidx = tl.arange(0, NBLK_PAD)
        block_max = tl.load(bmax_ptr + row * NBLK + bidx, mask=bidx < NBLK, other=-float("inf"), volatile=True)
        at_or_above = tl.zeros([NBLK_PAD], dtype=tl.int32)
        for j in range(NBLK_PAD // TILE):
            jidx = j * TILE + tl.arange(0, TILE)
            other = tl.load(bmax_ptr + row * NBLK + jidx, mask=jidx < NBLK, other=-float("inf"), volatile=True)
            at_or_above += tl.sum(((other[None, :] >= block_max[:, None]) & (jidx < NBLK)[None, :]).to(tl.int32),
                                  axis=1)
        t = tl.max(tl.where((bidx < NBLK) & (at_or_above >= c), block_max, -float("inf")), axis=0)
        phase = tl.where(k_on, _COUNT_COLLECT, tl.where(p_on, _MASS_COLLECT, _DONE))
        base = istate_ptr + row * _ISTATE
        tl.store(base + 0, phase.to(tl.int64))
        tl.store(base + 1, ((greedy == 0) & (k_on == 0)).to(tl.int64))  # Z over the row is needed
        least = tl.min(tl.load(cmin_ptr + row * NCHUNK + cidx, mask=cidx < NCHUNK, other=float("inf"),
                               volatile=True), axis=0)
        top = order_key(m, argmax)
        tl.store(base + 2, order_key(t, argmax * 0 + (VOCAB - 1)))  # x >= t
        tl.store(base + 3, top)
        tl.store(base + 5, order_key(least, argmax * 0 + (VOCAB - 1)))
        tl.store(base + 6, top)
        tl.store(cut_x_ptr + row, -float("inf"))
        tl.store(cut_id_ptr + row, argmax * 0 + (VOCAB - 1))
        tl.store(fstate_ptr + row * _FSTATE + 2, 1.0)  # greedy rows: defined, never read for their tokens


# -- pass 2+: collect and resolve, or bisect ------------------------------------------------------------

@triton.jit
def _select_work(row, chunk, logits_ptr, stride_row, temperature, m, istate_ptr, pi_ptr, pf_ptr, buf_ptr,
                 bufcount_ptr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr, BLOCKS: tl.constexpr,
                 NCHUNK: tl.constexpr, CAP: tl.constexpr, NT: tl.constexpr, BLOCK_R: tl.constexpr,
                 ROUNDS: tl.constexpr):
    """One program's share of a step over blocks [chunk * BLOCKS, (chunk + 1) * BLOCKS) of the row.

    Collect (and Z): appends the keys in [lo, hi] to the row's buffer; partials: count and mass
    above hi, mass in the bracket, Z. Bisect: count and mass at or above each of NT keys.
    """
    base = istate_ptr + row * _ISTATE
    phase = tl.load(base + 0)
    zflag = tl.load(base + 1)
    lo = tl.load(base + 2)
    hi = tl.load(base + 3)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    m64 = m.to(tl.float64)
    slot = row * NCHUNK + chunk
    collect = (phase == _COUNT_COLLECT) | (phase == _MASS_COLLECT)
    if collect | (zflag != 0):
        offs = tl.arange(0, BLOCK_V)
        n_above = slot.to(tl.int64) * 0
        s_above = n_above.to(tl.float64)
        s_in = n_above.to(tl.float64)
        z = n_above.to(tl.float64)
        for b in range(BLOCKS):
            ids = (chunk * BLOCKS + b) * BLOCK_V + offs
            valid = ids < VOCAB
            x = tl.math.div_rn(tl.load(row_ptr + ids, mask=valid, other=-float("inf")).to(tl.float32), temperature)
            key = order_key(x, ids)
            inside = collect & valid & (key >= lo) & (key <= hi)
            above = collect & valid & (key > hi)
            # most blocks of a top-k row hold no candidate: one reduction, no fp64 exponentials
            if (zflag != 0) | (tl.max((inside | above).to(tl.int32), axis=0) > 0):
                w = tl.where(valid, tl.exp(x.to(tl.float64) - m64), 0.0)
                z += tl.sum(w, axis=0)
                s_above += tl.sum(tl.where(above, w, 0.0), axis=0)
                s_in += tl.sum(tl.where(inside, w, 0.0), axis=0)
                n_above += tl.sum(above.to(tl.int64), axis=0)
                n_in = tl.sum(inside.to(tl.int32), axis=0)
                if n_in > 0:
                    start = tl.atomic_add(bufcount_ptr + row, n_in)
                    pos = start + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                    tl.store(buf_ptr + row * CAP + pos, key, mask=inside & (pos < CAP))
        tl.store(pi_ptr + slot * (3 * NT + 2) + 3 * NT, n_above)
        tl.store(pf_ptr + slot * (NT + 3) + NT, s_above)
        tl.store(pf_ptr + slot * (NT + 3) + NT + 1, s_in)
        tl.store(pf_ptr + slot * (NT + 3) + NT + 2, z)
    if ROUNDS and ((phase == _COUNT_ROUNDS) | (phase == _MASS_ROUNDS)):
        nidx = tl.arange(0, NT)
        step = (hi - lo) // NT + 1
        tau = lo + nidx.to(tl.int64) * step
        count = tl.zeros([NT], dtype=tl.int64)
        mass = tl.zeros([NT], dtype=tl.float64)
        least_ge = tl.full([NT], _KEY_MAX, tl.int64)
        most_lt = tl.full([NT], -1, tl.int64)
        most_in = lo * 0 - 1
        roffs = tl.arange(0, BLOCK_R)
        for b in range(BLOCKS * (BLOCK_V // BLOCK_R)):
            ids = chunk * BLOCKS * BLOCK_V + b * BLOCK_R + roffs
            valid = ids < VOCAB
            x = tl.math.div_rn(tl.load(row_ptr + ids, mask=valid, other=-float("inf")).to(tl.float32), temperature)
            key = order_key(x, ids)
            inside = valid & (key >= lo) & (key <= hi)
            if tl.max(inside.to(tl.int32), axis=0) > 0:
                w = tl.where(inside & (phase == _MASS_ROUNDS), tl.exp(x.to(tl.float64) - m64), 0.0)
                at_or_above = key[:, None] >= tau[None, :]
                ge = inside[:, None] & at_or_above
                count += tl.sum(ge.to(tl.int64), axis=0)
                mass += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
                # the keys present at the edges of each sub-range tighten the next bracket to the data
                least_ge = tl.minimum(least_ge, tl.min(tl.where(ge, key[:, None], _KEY_MAX), axis=0))
                most_lt = tl.maximum(most_lt, tl.max(tl.where(inside[:, None] & ~at_or_above, key[:, None], -1),
                                                     axis=0))
                most_in = tl.maximum(most_in, tl.max(tl.where(inside, key, -1), axis=0))
        base_i = pi_ptr + slot * (3 * NT + 2)
        tl.store(base_i + nidx, count)
        tl.store(base_i + NT + nidx, least_ge)
        tl.store(base_i + 2 * NT + nidx, most_lt)
        tl.store(base_i + 3 * NT + 1, most_in)
        tl.store(pf_ptr + slot * (NT + 3) + nidx, mass)


@triton.jit
def _select_advance(row, top_k, top_p, p_on, m, istate_ptr, fstate_ptr, cut_x_ptr, cut_id_ptr, pi_ptr, pf_ptr,
                    buf_ptr, bufcount_ptr, NPART: tl.constexpr, NPART_PAD: tl.constexpr, NCHUNK: tl.constexpr,
                    CAP: tl.constexpr, NT: tl.constexpr, TILE: tl.constexpr, ROUNDS: tl.constexpr):
    """The last program of a row: combine the NPART partials and move the row to its next phase."""
    base = istate_ptr + row * _ISTATE
    fbase = fstate_ptr + row * _FSTATE
    phase = tl.load(base + 0)
    zflag = tl.load(base + 1)
    lo = tl.load(base + 2)
    hi = tl.load(base + 3)
    m64 = m.to(tl.float64)
    pidx = tl.arange(0, NPART_PAD)
    pmask = pidx < NPART
    slot = row * NCHUNK + pidx
    target = tl.load(fbase + 1)
    if zflag != 0:
        z = tl.sum(tl.load(pf_ptr + slot * (NT + 3) + NT + 2, mask=pmask, other=0.0, volatile=True), axis=0)
        target = top_p.to(tl.float64) * z
        tl.store(fbase + 1, target)
        tl.store(fbase + 2, z)  # z_kept of a row without a filter
        tl.store(base + 1, zflag * 0)
    count_phase = (phase == _COUNT_ROUNDS) | (phase == _COUNT_COLLECT)
    # counts ride in fp64 (exact below 2^53) so one comparison serves both criteria
    goal = tl.where(count_phase, top_k.to(tl.float64), target)
    if (phase == _COUNT_COLLECT) | (phase == _MASS_COLLECT):
        n_col = tl.atomic_xchg(bufcount_ptr + row, 0).to(tl.int64)
        n_above = tl.sum(tl.load(pi_ptr + slot * (3 * NT + 2) + 3 * NT, mask=pmask, other=0, volatile=True), axis=0)
        s_above = tl.sum(tl.load(pf_ptr + slot * (NT + 3) + NT, mask=pmask, other=0.0, volatile=True), axis=0)
        s_in = tl.sum(tl.load(pf_ptr + slot * (NT + 3) + NT + 1, mask=pmask, other=0.0, volatile=True), axis=0)
        f_above = tl.where(count_phase, n_above.to(tl.float64), s_above)
        f_in = tl.where(count_phase, n_col.to(tl.float64), s_in)
        if (f_above + f_in < goal) & (lo > tl.load(base + 5)):
            # the cut lies below the bracket (step 0's candidates did not reach it): bisect [lowest, lo - 1]
            tl.store(base + 0, phase - 1)
            tl.store(base + 2, tl.load(base + 5))
            tl.store(base + 3, lo - 1)
            tl.store(base + 4, n_above + n_col)
            tl.store(fbase + 0, s_above + s_in)
        elif n_col > CAP:
            tl.store(base + 0, phase - 1)
            tl.store(base + 4, n_above)
            tl.store(fbase + 0, s_above)
        else:
            lowest = lo * 0
            cut_key, kept_mass = _rank_cut(buf_ptr + row * CAP, n_col, m64, lowest, goal, count_phase, n_above,
                                           s_above, CAP, TILE)
            # a top-k row with top-p: top-p inside the top-k set, over its renormalised mass
            goal_p = top_p.to(tl.float64) * kept_mass
            chained = count_phase & p_on
            if chained & (s_above < goal_p):
                cut_key, kept_mass = _rank_cut(buf_ptr + row * CAP, n_col, m64, cut_key, goal_p, n_col < 0,
                                               n_above, s_above, CAP, TILE)
            if chained & (s_above >= goal_p):
                # the top-p cut lies above this bracket: bisect (hi, the top] by mass
                tl.store(base + 0, phase * 0 + _MASS_ROUNDS)
                tl.store(base + 2, hi + 1)
                tl.store(base + 3, tl.load(base + 6))
                tl.store(base + 4, hi * 0)
                tl.store(fbase + 0, goal_p * 0.0)
                tl.store(fbase + 1, goal_p)
            else:
                tl.store(base + 0, phase * 0 + _DONE)
                tl.store(cut_x_ptr + row, key_x(cut_key))
                tl.store(cut_id_ptr + row, key_id(cut_key))
                tl.store(fbase + 2, kept_mass)
    if ROUNDS and ((phase == _COUNT_ROUNDS) | (phase == _MASS_ROUNDS)):
        nidx = tl.arange(0, NT)
        tile = slot[:, None] * (3 * NT + 2) + nidx[None, :]
        count = tl.sum(tl.load(pi_ptr + tile, mask=pmask[:, None], other=0, volatile=True), axis=0)
        least_ge = tl.min(tl.load(pi_ptr + tile + NT, mask=pmask[:, None], other=_KEY_MAX, volatile=True), axis=0)
        most_lt = tl.max(tl.load(pi_ptr + tile + 2 * NT, mask=pmask[:, None], other=-1, volatile=True), axis=0)
        most_in = tl.max(tl.load(pi_ptr + slot * (3 * NT + 2) + 3 * NT + 1, mask=pmask, other=-1, volatile=True),
                         axis=0)
        mass = tl.sum(tl.load(pf_ptr + slot[:, None] * (NT + 3) + nidx[None, :], mask=pmask[:, None], other=0.0,
                              volatile=True), axis=0)
        c_above = tl.load(base + 4)
        s_above = tl.load(fbase + 0)
        reach = tl.where(count_phase, c_above.to(tl.float64) + count.to(tl.float64), s_above + mass)
        # reach falls with the key: the cut is in the last sub-range whose reach meets the goal
        star = tl.maximum(tl.sum((reach >= goal).to(tl.int32), axis=0) - 1, 0)
        step = (hi - lo) // NT + 1
        inner = star < NT - 1
        count_star = _pick(count, nidx, star)
        count_next = tl.where(inner, _pick(count, nidx, star + 1), 0)
        mass_next = tl.where(inner, _pick(mass, nidx, star + 1), 0.0)
        # the sub-range [tau_star, tau_star+1), shrunk to the least and greatest keys present in it
        new_lo = lo + star.to(tl.int64) * step
        new_hi = tl.where(inner, tl.minimum(hi, new_lo + step - 1), hi)
        present = count_star > count_next
        new_lo = tl.where(present, tl.maximum(new_lo, _pick(least_ge, nidx, star)), new_lo)
        new_hi = tl.where(present, tl.minimum(new_hi, tl.where(inner, _pick(most_lt, nidx, star + 1), most_in)),
                          new_hi)
        tl.store(base + 2, new_lo)
        tl.store(base + 3, new_hi)
        tl.store(base + 4, c_above + count_next)
        tl.store(fbase + 0, s_above + mass_next)
        tl.store(base + 0, tl.where(count_star - count_next <= CAP, phase + 1, phase))


@triton.jit
def _select_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, m_ptr, istate_ptr, fstate_ptr,
                   cut_x_ptr, cut_id_ptr, pi_ptr, pf_ptr, buf_ptr, bufcount_ptr, arrivals_ptr,
                   ROWS_PER_REQ: tl.constexpr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr, BPC: tl.constexpr,
                   NCHUNK: tl.constexpr, NCHUNK_PAD: tl.constexpr, CAP: tl.constexpr, NT: tl.constexpr,
                   BLOCK_R: tl.constexpr, TILE: tl.constexpr, ROUNDS: tl.constexpr):
    """One step of every open row; ROUNDS=False compiles step 0 alone (no row bisects yet)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    phase = tl.load(istate_ptr + row * _ISTATE + 0)
    zflag = tl.load(istate_ptr + row * _ISTATE + 1)
    if (phase != _DONE) | (zflag != 0):
        temperature, greedy, k_on, p_on, top_k, top_p = row_params(temperature_ptr, top_k_ptr, top_p_ptr,
                                                                   row // ROWS_PER_REQ, VOCAB)
        m = tl.load(m_ptr + row)
        _select_work(row, chunk, logits_ptr, stride_row, temperature, m, istate_ptr, pi_ptr, pf_ptr, buf_ptr,
                     bufcount_ptr, VOCAB, BLOCK_V, BPC, NCHUNK, CAP, NT, BLOCK_R, ROUNDS)
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + row, 1) == NCHUNK - 1:
            tl.store(arrivals_ptr + row, 0)
            _select_advance(row, top_k, top_p, p_on, m, istate_ptr, fstate_ptr, cut_x_ptr, cut_id_ptr, pi_ptr,
                            pf_ptr, buf_ptr, bufcount_ptr, NCHUNK, NCHUNK_PAD, NCHUNK, CAP, NT, TILE, ROUNDS)


@triton.jit
def _select_finish_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, m_ptr, istate_ptr,
                          fstate_ptr, cut_x_ptr, cut_id_ptr, pi_ptr, pf_ptr, buf_ptr, bufcount_ptr,
                          ROWS_PER_REQ: tl.constexpr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCKS: tl.constexpr, NCHUNK: tl.constexpr, CAP: tl.constexpr, NT: tl.constexpr,
                          BLOCK_R: tl.constexpr, TILE: tl.constexpr, ITERS: tl.constexpr):
    """One program per row takes the remaining steps itself (every block, partial slot 0)."""
    row = tl.program_id(0)
    temperature, greedy, k_on, p_on, top_k, top_p = row_params(temperature_ptr, top_k_ptr, top_p_ptr,
                                                               row // ROWS_PER_REQ, VOCAB)
    m = tl.load(m_ptr + row)
    steps = row * 0
    open_row = (tl.load(istate_ptr + row * _ISTATE + 0) != _DONE) | (tl.load(istate_ptr + row * _ISTATE + 1) != 0)
    while open_row & (steps < ITERS):
        _select_work(row, 0, logits_ptr, stride_row, temperature, m, istate_ptr, pi_ptr, pf_ptr, buf_ptr,
                     bufcount_ptr, VOCAB, BLOCK_V, BLOCKS, NCHUNK, CAP, NT, BLOCK_R, True)
        tl.debug_barrier()
        _select_advance(row, top_k, top_p, p_on, m, istate_ptr, fstate_ptr, cut_x_ptr, cut_id_ptr, pi_ptr,
                        pf_ptr, buf_ptr, bufcount_ptr, 1, 2, NCHUNK, CAP, NT, TILE, True)
        tl.debug_barrier()
        open_row = ((tl.load(istate_ptr + row * _ISTATE + 0, volatile=True) != _DONE)
                    | (tl.load(istate_ptr + row * _ISTATE + 1, volatile=True) != 0))
        steps += 1


@dataclass(frozen=True)
class _Plan:
    """Which select launches a batch needs, from the host's summary of its parameters."""

    any_sampled: bool
    rounds: bool
    finisher: bool


def _plan(st, layout: Layout, cfg: FilterConfig) -> _Plan:
    host = getattr(st, "host", None)
    if host is None:  # nothing known: every launch (each exits at once for rows it has no work on)
        return _Plan(True, True, True)
    # step 0 resolves a top-k row when its candidates (about top_k of them, more with ties) fit the buffer
    rounds = host.any_top_p_only or host.max_top_k > min(layout.num_blocks, cfg.cap // 2)
    return _Plan(host.any_sampled, rounds, host.any_filtered)


def filter_triton(logits: Tensor, st, rows_per_request: int = 1, config: FilterConfig = DEFAULT_CONFIG) -> RowFilter:
    """``filter_torch`` by the kernels  # logits [R, V] (row r takes request r // rows_per_request's parameters)."""
    rows, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    cfg, layout = config, Layout.of(vocab, config)
    device = logits.device
    m = torch.empty(rows, dtype=torch.float32, device=device)
    argmax = torch.empty(rows, dtype=torch.int64, device=device)
    cut_x = torch.empty(rows, dtype=torch.float32, device=device)
    cut_id = torch.empty(rows, dtype=torch.int64, device=device)
    istate = torch.empty((rows, 7), dtype=torch.int64, device=device)
    fstate = torch.empty((rows, 3), dtype=torch.float64, device=device)
    result = RowFilter(m, argmax, cut_x, cut_id, fstate[:, 2])
    if rows == 0:
        return result
    counters = torch.zeros(2 * rows, dtype=torch.int32, device=device)  # arrivals, buffer fill; reset by the kernels
    arrivals, bufcount = counters[:rows], counters[rows:]
    nchunk, nblk = layout.num_chunks, layout.num_blocks
    nblk_pad = max(2, triton.next_power_of_2(nblk))
    common = dict(ROWS_PER_REQ=rows_per_request, VOCAB=vocab, BLOCK_V=layout.block_v)
    bmax = torch.empty((rows, nblk), dtype=torch.float32, device=device)
    cmax = torch.empty((rows, nchunk), dtype=torch.float32, device=device)
    cmin = torch.empty((rows, nchunk), dtype=torch.float32, device=device)
    carg = torch.empty((rows, nchunk), dtype=torch.int32, device=device)
    grid = (rows, nchunk)
    _stats_kernel[grid](logits, logits.stride(0), st.temperature, st.top_k, st.top_p, bmax, cmax, cmin, carg, arrivals,
                        m, argmax, istate, cut_x, cut_id, fstate, BPC=layout.blocks_per_chunk, NCHUNK=nchunk,
                        NCHUNK_PAD=layout.num_chunks_pad, NBLK=nblk, NBLK_PAD=nblk_pad,
                        CAND_P=min(cfg.cap // 2, nblk), TILE=min(8, nblk_pad), **common)
    plan = _plan(st, layout, cfg)
    if not plan.any_sampled:
        return result
    nt = cfg.thresholds
    pi = torch.empty((rows, nchunk, 3 * nt + 2), dtype=torch.int64, device=device)
    pf = torch.empty((rows, nchunk, nt + 3), dtype=torch.float64, device=device)
    buf = torch.empty((rows, cfg.cap), dtype=torch.int64, device=device)
    args = (logits, logits.stride(0), st.temperature, st.top_k, st.top_p, m, istate, fstate, cut_x, cut_id, pi, pf,
            buf, bufcount)
    shape = dict(CAP=cfg.cap, NT=nt, BLOCK_R=layout.block_r, TILE=min(32, cfg.cap), **common)
    for step in range(1 + (cfg.rounds if plan.rounds else 0)):  # step 0 (collect, Z), then bisection rounds
        _select_kernel[grid](*args, arrivals, BPC=layout.blocks_per_chunk, NCHUNK=nchunk,
                             NCHUNK_PAD=layout.num_chunks_pad, ROUNDS=step > 0, **shape)
    if plan.finisher:
        _select_finish_kernel[(rows,)](*args, BLOCKS=nchunk * layout.blocks_per_chunk, NCHUNK=nchunk,
                                       ITERS=cfg.finisher_iters, **shape)
    return result
