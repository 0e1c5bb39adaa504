"""The gated delta rule row by row, for decode and verify steps, twin of
``reference/model/delta_rule.gated_delta_rule_recurrent``; and the one row update that the verify
commit's replay (fast/kernels/gdn/gdn_commit.py) shares with it.

B sequences; sequence b owns rows ``cu_seqlens[b] .. cu_seqlens[b+1]-1`` (at most ``max_rows``:
1 for decode, k+1 for verify). Per value head h (key head ``h // (Hv / Hk)``), from the state
``S [Dk, Dv]``, each row t does::

    S'_t = exp(g_t) S_{t-1};   u_t = beta_t (v_t - S'_t^T k_t);   S_t = S'_t + k_t u_t^T;   o_t = S_t^T q_t

(the first three are :func:`delta_rule_step` and :func:`delta_rule_step_torch`). Inputs as
``delta_rule.gated_delta_rule`` receives them: q, k ``[N, Hk, Dk]`` already L2-normalised, q already
scaled by ``Dk^-1/2``; v ``[N, Hv, Dv]``; g (log-decay), beta ``[N, Hv]``. Any float dtype in; all
arithmetic in fp32; o ``[N, Hv, Dv]`` fp32.

State in: ``initial_state`` fp32 ``[S, Hv, Dk, Dv]``; sequence b starts from row
``state_index[b]`` of it (default b; a negative index starts from zeros and reads nothing, so a
NaN there cannot leak). Out, any of:

- ``verify_rows`` (verify: rollback by replay): a :class:`VerifyRowInputs` receives every row's
  recurrence inputs at ``[b, r]`` (r < the sequence's row count): k fp32 ``[>= B, >= max_rows,
  Hk, Dk]``, v ``[.., Hv, Dv]`` (v's dtype or fp32, so stored without rounding), g, beta fp32
  ``[.., Hv]``, exactly the fp32 values the recurrence used. Nothing else in it is written, and
  the states are never written on a verify: the commit replays the kept rows from the slot's
  pre-step state (at Hv = 32, Hk = 16, Dk = Dv = 128, bf16 and 8 rows: 130 KiB of inputs per
  layer and sequence, where a state per row took 16 MiB).
- ``output_final_state``: the state after each sequence's last row, fp32 ``[B, Hv, Dk, Dv]``.
- ``final_state_index`` (decode): the same final states written in place into the pool
  ``initial_state`` at row ``final_state_index[b]``. Safe with ``state_index`` pointing at the same
  rows: each program reads its whole ``[Dk, block_v]`` tile of the state first and writes it last
  (a zero-state sequence reads nothing, index -1, and still writes its row); rows written by two
  sequences (the trash slot of padding sequences) end up holding one of them.

``gated_delta_rule_verify_torch`` pads the rows to ``[B, max_rows]`` and loops (CPU, or any
device as a fallback). ``gated_delta_rule_verify_triton``: one program per (sequence, value head,
Dv block of ``block_v``) keeps its ``[Dk, block_v]`` slice of the state in registers and walks
the rows (up to 16 the row count is a constexpr, ``max_rows`` itself, and rows past a sequence's
end are masked to g = 0, beta = 0, k = 0, which leaves the state unchanged; past 16, a prefill
chunk's program loops over its own sequence's rows, loading row t+1 before row t's math, so one
compile serves every length and a short sequence does no masked rows). The program of a value head's first
Dv block stores the row's g and beta (and k, for the first value head of each key head); every
program stores its own slice of v. The products are elementwise with fp32 reductions over Dk,
no tensor cores, so fp32 inputs match the reference to rounding.

Unrolled (2 to ``EXACT_ROWS`` rows, a verify): the row loop is a ``tl.static_range`` and nothing is
stored inside it (each row's o goes into a ``[ROWS_PAD, block_v]`` register tile by a select, stored
after the loop with the scratch inputs, which are reloaded as tiles), so no store sits between one
row's loads and the next's and the compiler may issue every row's q, k, v, g, beta loads up front:
the looped form waits on each row's loads in turn, so at a verify's rows the unrolled form is the faster
(measured: bench/results/2026-12-02-h200-perf6/README.md). Both forms run the same ``_row_step``, so
the state and o have the same bits either way.

The rows as one chunk, with no state carried from row to row (as fp32 products, the reference's chunked form,
or by forward substitution on the corrections), was tried and was level at one request and slower at 4 and 16
(measured: bench/results/2026-12-03-h200-perf12/README.md). An ncu profile there says why: at one request the
256 one-warp programs leave each multiprocessor two warps, each issuing its own instruction stream; taking work
off the chain adds no warps.

The commit's replay runs :func:`delta_rule_step` on the same ``[DK_PAD, block_v]`` tiles
(``default_block_v``) with ``NUM_WARPS`` warps, so ``tl.sum`` reduces in the same order and the
replayed state is bit for bit the state this kernel reached after the same rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..common.triton_compat import tl, triton

EXACT_ROWS = 16  # up to this many rows the loop length is max_rows itself; above, each sequence's own length (a
# verify's stored inputs past 16 rows: the next power of two)
UNROLL_MIN_ROWS = 2  # from 2 rows (a verify) to EXACT_ROWS the row loop is unrolled (module docstring); a decode's
# one row keeps the plain loop
# The state tile, of every state-tile program, here and in the commit's replay (one layout, one tl.sum order):
# [Dk, 16] on one warp: of the nine tiles swept at the 35B-A3B shapes (bench_gdn_verify.py --tiles: verify,
# decode and the whole commit) the fastest at B = 1 and 4, but for [Dk, 16] on two warps at a B = 1 verify alone
# (measured: bench/results/2026-12-02-h200-perf8/call2-gdn_tiles.log).
NUM_WARPS = 1
BLOCK_V = 16


class VerifyRowInputs(NamedTuple):
    """The recurrence inputs of every row of a verify step, at ``[..., b, r]`` (b the sequence's index in
    the batch, r its row): what the commit replays the kept rows from. Leading axes ``[...]``: none for
    one layer, ``[L]`` for the pools' stack."""
    k: Tensor  # [..., B', R, Hk, Dk] fp32, L2-normalised
    v: Tensor  # [..., B', R, Hv, Dv] in v's dtype or fp32
    g: Tensor  # [..., B', R, Hv] fp32, log-decay
    beta: Tensor  # [..., B', R, Hv] fp32


def default_block_v(value_dim: int) -> int:
    """The Dv slice of one state-tile program, unless the launcher is given another."""
    return min(BLOCK_V, triton.next_power_of_2(value_dim))


def delta_rule_step_torch(s: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One row: ``S'_t = exp(g_t) S_{t-1}; u_t = beta_t (v_t - S'_t^T k_t); S_t = S'_t + k_t u_t^T``, fp32.

    s ``[B, Hv, Dk, Dv]``; k ``[B, Hv, Dk]`` (already repeated to the value heads); v ``[B, Hv, Dv]``;
    g, beta ``[B, Hv]``. Returns S_t. The product is a ``[1, Dk] @ [Dk, Dv]`` matmul per head: the bmm
    an einsum would run, without its parsing (which costs more than the arithmetic at decode sizes).
    """
    s = torch.exp(g)[..., None, None] * s  # S'_t
    predicted = (k[..., None, :] @ s)[..., 0, :]  # S'_t^T k_t                         [B, Hv, Dv]
    u = beta[..., None] * (v - predicted)  # u_t                                      [B, Hv, Dv]
    return s + k[..., :, None] * u[..., None, :]  # S_t = S'_t + k_t u_t^T            [B, Hv, Dk, Dv]


def store_row_inputs_torch(verify_rows: VerifyRowInputs, seq_index: Tensor, row_in_seq: Tensor, k: Tensor,
                           v: Tensor, g: Tensor, beta: Tensor) -> None:
    """``verify_rows[seq_index[n], row_in_seq[n]] = row n's (k, v, g, beta)``, k, g, beta as fp32
    (k ``[N, Hk, Dk]``, v ``[N, Hv, Dv]``, g, beta ``[N, Hv]``)."""
    for scratch, x in zip(verify_rows, (k.float(), v, g.float(), beta.float())):
        scratch[seq_index, row_in_seq] = x.to(scratch.dtype)


def check_gdn_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor) -> None:
    """The shapes both GDN kernels take: q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv], states [S, Hv, Dk, Dv]."""
    rows, key_heads, key_dim = q.shape
    _, value_heads, value_dim = v.shape
    if k.shape != q.shape or v.shape[0] != rows or value_heads % key_heads:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: expected [N, Hk, Dk] twice "
                         f"and [N, Hv, Dv] with Hk dividing Hv")
    if g.shape != (rows, value_heads) or beta.shape != g.shape:
        raise ValueError(f"g {list(g.shape)}, beta {list(beta.shape)}: expected [{rows}, {value_heads}]")
    if initial_state.dim() != 4 or initial_state.shape[1:] != (value_heads, key_dim, value_dim):
        raise ValueError(f"initial_state {list(initial_state.shape)}: expected [S, {value_heads}, {key_dim}, "
                         f"{value_dim}]")


def check_verify_rows(verify_rows: VerifyRowInputs, leading: tuple[int, ...], key_heads: int, key_dim: int,
                      value_heads: int, value_dim: int) -> tuple[int, int]:
    """``verify_rows`` of shapes ``[*leading, B', R, ...]`` (module docstring) with k, g, beta fp32.
    Returns ``(B', R)``."""
    k, v, g, beta = verify_rows
    if k.dim() != len(leading) + 4 or tuple(k.shape[:len(leading)]) != leading:
        raise ValueError(f"verify_rows.k {list(k.shape)}: expected [{', '.join(map(str, leading + ('B', 'R')))}, "
                         f"{key_heads}, {key_dim}]")
    seqs_rows = tuple(k.shape[:len(leading) + 2])
    expected = {"k": (*seqs_rows, key_heads, key_dim), "v": (*seqs_rows, value_heads, value_dim),
                "g": (*seqs_rows, value_heads), "beta": (*seqs_rows, value_heads)}
    for name, t in zip(VerifyRowInputs._fields, verify_rows):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"verify_rows.{name} {list(t.shape)}: expected {list(expected[name])}")
        if name != "v" and t.dtype != torch.float32:
            raise ValueError(f"verify_rows.{name} {t.dtype}: expected fp32")
    return seqs_rows[-2], seqs_rows[-1]


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, cu_seqlens: Tensor,
           max_rows: int, state_index: Tensor | None, verify_rows: VerifyRowInputs | None,
           final_state_index: Tensor | None = None) -> int:
    check_gdn_inputs(q, k, v, g, beta, initial_state)
    rows, key_heads, key_dim = q.shape
    _, value_heads, value_dim = v.shape
    batch = cu_seqlens.shape[0] - 1
    if batch < 0 or max_rows < 1:
        raise ValueError(f"cu_seqlens {list(cu_seqlens.shape)}, max_rows={max_rows}: expected [B+1] and >= 1")
    if state_index is None and initial_state.shape[0] < batch:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states for {batch} sequences")
    if state_index is not None and state_index.shape != (batch,):
        raise ValueError(f"state_index {list(state_index.shape)}: expected [{batch}]")
    if final_state_index is not None and (final_state_index.shape != (batch,) or initial_state.dtype != torch.float32):
        raise ValueError(f"final_state_index {list(final_state_index.shape)} into {initial_state.dtype} states: "
                         f"expected [{batch}] into fp32")
    if verify_rows is not None:
        seqs, scratch_rows = check_verify_rows(verify_rows, (), key_heads, key_dim, value_heads, value_dim)
        if seqs < batch or scratch_rows < max_rows:
            raise ValueError(f"verify_rows [{seqs}, {scratch_rows}, ...]: expected [>= {batch}, >= {max_rows}, ...]")
        if verify_rows.v.dtype not in (v.dtype, torch.float32):
            raise ValueError(f"verify_rows.v {verify_rows.v.dtype}: expected v's {v.dtype} or fp32 (no rounding)")
    return batch


def gated_delta_rule_verify_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
                                  cu_seqlens: Tensor, max_rows: int, *, state_index: Tensor | None = None,
                                  verify_rows: VerifyRowInputs | None = None, output_final_state: bool = True,
                                  final_state_index: Tensor | None = None,
                                  block_v: int | None = None) -> tuple[Tensor, Tensor | None]:
    """q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv], initial_state fp32 [S, Hv, Dk, Dv], cu_seqlens [B+1]
    (at most ``max_rows`` rows each). Returns ``(o [N, Hv, Dv] fp32, final state [B, Hv, Dk, Dv] fp32 or None)``;
    stores every row's inputs in ``verify_rows`` when given, and the final states in
    ``initial_state[final_state_index]`` when given. ``block_v`` is the Triton launcher's and unused here."""
    batch = _check(q, k, v, g, beta, initial_state, cu_seqlens, max_rows, state_index, verify_rows, final_state_index)
    rows, value_heads = v.shape[:2]
    ratio = value_heads // q.shape[1]
    cu = cu_seqlens.long()
    seq_index = torch.searchsorted(cu[1:], torch.arange(rows, device=q.device), right=True)  # [N]
    row_in_seq = torch.arange(rows, device=q.device) - cu[seq_index]
    if verify_rows is not None:
        store_row_inputs_torch(verify_rows, seq_index, row_in_seq, k, v, g, beta)

    def pad(x: Tensor) -> Tensor:  # [N, ...] -> [B, max_rows, ...], zeros past each sequence's rows
        out = x.new_zeros((batch, max_rows, *x.shape[1:]))
        out[seq_index, row_in_seq] = x
        return out

    q, k = (pad(t.float().repeat_interleave(ratio, dim=1)) for t in (q, k))  # [B, R, Hv, Dk]
    v, g, beta = (pad(t.float()) for t in (v, g, beta))  # [B, R, Hv, Dv], [B, R, Hv] x2
    if state_index is None:
        s = initial_state[:batch].float().clone()  # [B, Hv, Dk, Dv]
    else:
        readable = state_index >= 0
        s = torch.where(readable[:, None, None, None], initial_state[state_index.clamp(min=0)].float(), 0.0)
    outputs = []
    for t in range(max_rows):
        s = delta_rule_step_torch(s, k[:, t], v[:, t], g[:, t], beta[:, t])  # S_t
        outputs.append((q[:, t, :, None, :] @ s)[..., 0, :])  # o_t = S_t^T q_t   [B, Hv, Dv]
    o = torch.stack(outputs, dim=1)[seq_index, row_in_seq]  # [N, Hv, Dv]
    if final_state_index is not None:  # s was computed from a copy of the starting states
        initial_state.index_copy_(0, final_state_index.long(), s)
    return o, (s if output_final_state else None)


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit
def delta_rule_step(s, k, v, g, beta):
    """One row on a ``[DK_PAD, BLOCK_V]`` state tile (fp32): k ``[DK_PAD]``, v ``[BLOCK_V]``, g, beta scalars.
    The recurrence and the commit's replay both call this, so both run the same statements."""
    s = s * tl.exp(g)  # S'_t
    u = beta * (v - tl.sum(s * k[:, None], axis=0))  # u_t = beta_t (v_t - S'_t^T k_t)   [BLOCK_V]
    return s + k[:, None] * u[None, :]  # S_t = S'_t + k_t u_t^T


@triton.jit
def _row_loads(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, n, active, stride_q, stride_k, stride_v, stride_g, stride_beta,
               key_head, h, dk, in_k, dv, in_v, DK: tl.constexpr, DV: tl.constexpr):
    """Row n's q, k (``[DK_PAD]``), v (``[BLOCK_V]``), g, beta in fp32; an inactive row (past the sequence)
    loads zeros: g = beta = k = 0 leave S as it is."""
    q = tl.load(q_ptr + n * stride_q + key_head * DK + dk, mask=in_k & active, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + n * stride_k + key_head * DK + dk, mask=in_k & active, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + n * stride_v + h * DV + dv, mask=in_v & active, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + n * stride_g + h, mask=active, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + n * stride_beta + h, mask=active, other=0.0).to(tl.float32)
    return q, k, v, g, beta


@triton.jit
def _row_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, n, active, stride_q, stride_k, stride_v, stride_g, stride_beta,
              key_head, h, dk, in_k, dv, in_v, DK: tl.constexpr, DV: tl.constexpr):
    """Row n's loads, its :func:`delta_rule_step` and ``o_t = S_t^T q_t``: returns (S_t, o_t, k, v, g, beta)."""
    q, k, v, g, beta = _row_loads(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, n, active, stride_q, stride_k, stride_v,
                                  stride_g, stride_beta, key_head, h, dk, in_k, dv, in_v, DK, DV)
    s = delta_rule_step(s, k, v, g, beta)
    return s, tl.sum(s * q[:, None], axis=0), k, v, g, beta


@triton.jit
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, state_index_ptr, cu_ptr, o_ptr,
                          final_ptr, final_index_ptr, rows_k_ptr, rows_v_ptr, rows_g_ptr, rows_beta_ptr, stride_q,
                          stride_k, stride_v, stride_g, stride_beta, stride_h0, scratch_rows,
                          ROWS: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, RATIO: tl.constexpr,
                          DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
                          USE_STATE_INDEX: tl.constexpr, STORE_INPUTS: tl.constexpr, STORE_FINAL: tl.constexpr,
                          STORE_IN_POOL: tl.constexpr, UNROLL: tl.constexpr, ROWS_PAD: tl.constexpr,
                          TO_LENGTH: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    key_head = h // RATIO
    dk = tl.arange(0, DK_PAD)
    in_k = dk < DK
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_v = dv < DV
    in_s = in_k[:, None] & in_v[None, :]
    s_offs = h * (DK * DV) + dk[:, None] * DV + dv[None, :]  # within one [Hv, Dk, Dv] state
    stores_gates = tl.program_id(2) == 0  # one program per value head stores g, beta
    stores_k = stores_gates & (h % RATIO == 0)  # and one per key head k

    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = tl.load(cu_ptr + b + 1).to(tl.int64) - bos
    if USE_STATE_INDEX:
        state_row = tl.load(state_index_ptr + b).to(tl.int64)
        s = tl.load(h0_ptr + tl.maximum(state_row, 0) * stride_h0 + s_offs, mask=in_s & (state_row >= 0),
                    other=0.0).to(tl.float32)
    else:
        s = tl.load(h0_ptr + b.to(tl.int64) * stride_h0 + s_offs, mask=in_s, other=0.0).to(tl.float32)

    if UNROLL:  # a verify's few rows: no store between the rows' loads (the module docstring, "Unrolled")
        rr = tl.arange(0, ROWS_PAD)
        row_live = rr < seq_len
        n_all = bos + rr
        o_all = tl.zeros([ROWS_PAD, BLOCK_V], dtype=tl.float32)
        for r in tl.static_range(ROWS):
            s, o, _, _, _, _ = _row_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, bos + r, r < seq_len, stride_q,
                                         stride_k, stride_v, stride_g, stride_beta, key_head, h, dk, in_k, dv, in_v, DK, DV)
            o_all = tl.where(rr[:, None] == r, o[None, :], o_all)  # a select: o's bits as computed
        tl.store(o_ptr + n_all[:, None] * (HV * DV) + h * DV + dv[None, :], o_all,
                 mask=row_live[:, None] & in_v[None, :])
        if STORE_INPUTS:  # the same loads as the rows above, as [ROWS_PAD, ...] tiles (cache hits)
            row = b.to(tl.int64) * scratch_rows + rr
            v_all = tl.load(v_ptr + n_all[:, None] * stride_v + h * DV + dv[None, :],
                            mask=row_live[:, None] & in_v[None, :], other=0.0).to(tl.float32)
            tl.store(rows_v_ptr + row[:, None] * (HV * DV) + h * DV + dv[None, :], v_all,
                     mask=row_live[:, None] & in_v[None, :])
            g_all = tl.load(g_ptr + n_all * stride_g + h, mask=row_live, other=0.0).to(tl.float32)
            beta_all = tl.load(beta_ptr + n_all * stride_beta + h, mask=row_live, other=0.0).to(tl.float32)
            tl.store(rows_g_ptr + row * HV + h, g_all, mask=row_live & stores_gates)
            tl.store(rows_beta_ptr + row * HV + h, beta_all, mask=row_live & stores_gates)
            k_live = row_live[:, None] & in_k[None, :]
            k_all = tl.load(k_ptr + n_all[:, None] * stride_k + key_head * DK + dk[None, :], mask=k_live,
                            other=0.0).to(tl.float32)
            tl.store(rows_k_ptr + row[:, None] * (HK * DK) + key_head * DK + dk[None, :], k_all,
                     mask=k_live & stores_k)
    elif TO_LENGTH:  # a prefill chunk: each sequence's own rows, the next row's loads issued before this row's math
        q, k, v, g, beta = _row_loads(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, bos, seq_len > 0, stride_q, stride_k,
                                      stride_v, stride_g, stride_beta, key_head, h, dk, in_k, dv, in_v, DK, DV)
        n = bos  # a while loop: the interpreter cannot take a runtime range bound (triton_compat)
        while n < bos + seq_len:
            q_next, k_next, v_next, g_next, beta_next = _row_loads(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, n + 1, n + 1 < bos + seq_len, stride_q, stride_k, stride_v,
                stride_g, stride_beta, key_head, h, dk, in_k, dv, in_v, DK, DV)
            s = delta_rule_step(s, k, v, g, beta)
            tl.store(o_ptr + n * (HV * DV) + h * DV + dv, tl.sum(s * q[:, None], axis=0), mask=in_v)
            q, k, v, g, beta = q_next, k_next, v_next, g_next, beta_next
            n += 1
    else:
        for r in range(ROWS):
            active = r < seq_len
            n = bos + r
            s, o, k, v, g, beta = _row_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, n, active, stride_q, stride_k,
                                            stride_v, stride_g, stride_beta, key_head, h, dk, in_k, dv, in_v, DK, DV)
            tl.store(o_ptr + n * (HV * DV) + h * DV + dv, o, mask=in_v & active)
            if STORE_INPUTS:  # dense [B', R, ...] scratch; v rounds back to its own dtype exactly
                row = b.to(tl.int64) * scratch_rows + r
                tl.store(rows_v_ptr + row * (HV * DV) + h * DV + dv, v, mask=in_v & active)
                tl.store(rows_g_ptr + row * HV + h, g, mask=active & stores_gates)
                tl.store(rows_beta_ptr + row * HV + h, beta, mask=active & stores_gates)
                tl.store(rows_k_ptr + row * (HK * DK) + key_head * DK + dk, k, mask=in_k & active & stores_k)
    if STORE_FINAL:
        tl.store(final_ptr + b.to(tl.int64) * (HV * DK * DV) + s_offs, s, mask=in_s)
    if STORE_IN_POOL:  # in place: this program read its tile of the pool above, before the row loop
        final_row = tl.load(final_index_ptr + b).to(tl.int64)
        tl.debug_barrier()  # every thread's read of the old tile happens before any write of the new one
        tl.store(h0_ptr + final_row * stride_h0 + s_offs, s, mask=in_s)


def _rows_ok(t: Tensor) -> Tensor:
    """``t`` itself when its last two axes are dense ([row stride, D, 1]), else a contiguous copy."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def gated_delta_rule_verify_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
                                   cu_seqlens: Tensor, max_rows: int, *, state_index: Tensor | None = None,
                                   verify_rows: VerifyRowInputs | None = None, output_final_state: bool = True,
                                   final_state_index: Tensor | None = None,
                                   block_v: int | None = None) -> tuple[Tensor, Tensor | None]:
    """``gated_delta_rule_verify_torch`` by the Triton kernel (same arguments and result); ``block_v``
    (a power of two) is the Dv slice each program keeps, default ``default_block_v(Dv)``. ``verify_rows``
    must be contiguous (the pools' per-layer views are)."""
    batch = _check(q, k, v, g, beta, initial_state, cu_seqlens, max_rows, state_index, verify_rows, final_state_index)
    rows, value_heads, value_dim = v.shape
    key_heads, key_dim = q.shape[1:]
    q, k, v = (_rows_ok(t) for t in (q, k, v))
    g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, beta))
    if initial_state.dtype != torch.float32 or not initial_state[0:1].is_contiguous():
        raise ValueError("initial_state: expected fp32 with dense [Hv, Dk, Dv] states")
    if verify_rows is not None and not all(t.is_contiguous() for t in verify_rows):
        raise ValueError("verify_rows: expected contiguous tensors")
    block_v = default_block_v(value_dim) if block_v is None else block_v
    o = torch.empty((rows, value_heads, value_dim), dtype=torch.float32, device=q.device)
    final = (torch.empty((batch, value_heads, key_dim, value_dim), dtype=torch.float32, device=q.device)
             if output_final_state else None)
    if batch == 0:
        return o, final
    dummy = o  # stands in for the pointers a constexpr switch leaves unread
    scratch = (dummy,) * 4 if verify_rows is None else tuple(verify_rows)
    # past EXACT_ROWS without a verify's stores, each program loops over its own sequence's rows: one compile for
    # every prefill length (ROWS unused), and no masked rows past a shorter sequence's end
    to_length = max_rows > EXACT_ROWS and verify_rows is None
    if max_rows <= EXACT_ROWS:
        loop_rows = max_rows
    else:
        loop_rows = EXACT_ROWS + 1 if to_length else triton.next_power_of_2(max_rows)
    _gdn_recurrent_kernel[(batch, value_heads, triton.cdiv(value_dim, block_v))](
        q, k, v, g, beta, initial_state,
        dummy if state_index is None else state_index.to(torch.int64).contiguous(),
        cu_seqlens.contiguous(), o, dummy if final is None else final,
        dummy if final_state_index is None else final_state_index.contiguous(), *scratch, q.stride(0), k.stride(0),
        v.stride(0), g.stride(0), beta.stride(0), initial_state.stride(0),
        0 if verify_rows is None else verify_rows.k.shape[1],
        ROWS=loop_rows, HK=key_heads, HV=value_heads,
        RATIO=value_heads // key_heads, DK=key_dim, DV=value_dim, DK_PAD=triton.next_power_of_2(key_dim),
        BLOCK_V=block_v, USE_STATE_INDEX=state_index is not None, STORE_INPUTS=verify_rows is not None,
        STORE_FINAL=final is not None, STORE_IN_POOL=final_state_index is not None,
        UNROLL=UNROLL_MIN_ROWS <= loop_rows <= EXACT_ROWS, ROWS_PAD=triton.next_power_of_2(loop_rows),
        TO_LENGTH=to_length, num_warps=NUM_WARPS)
    return o, final
