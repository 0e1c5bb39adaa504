"""Batched verification of k drafts per request, twin of ``reference/speculative/verify.py``.

For each request b (target rows b*(k+1) + i, row i giving p_{i+1}), with the request's sampling
parameters and the filtered target distribution computed in place from the logits:

- greedy requests: the longest prefix with y_i = argmax(row i-1) (lowest id on ties), then the
  argmax of the first mismatching row (or of row k);
- sampled requests (sparse-q rejection): slot i's q row is ``draft_probs [K]`` over
  ``cand_ids [K]``. A row that is NaN/inf anywhere, has a negative entry, sums to 0 or gives y_i
  no mass is untrusted: the slot is rejected and its token drawn from p_i. Otherwise it is divided
  by its total and y_i is accepted iff ``accept_u_i * q_i(y_i) < p_i(y_i)`` (fp64). At the first
  rejection the token is drawn from ``max(0, p - q)`` (from p if that has no mass, or if the row
  was untrusted) with residual_u; after k acceptances a bonus from p_{k+1} with bonus_u.
  Uniforms: ``uniform(seed, s, ACCEPT, i)``, ``(seed, s, RESIDUAL, 0)``, ``(seed, s, BONUS, 0)``.

Outputs: ``num_accepted [B]`` and ``emitted [B, k+1]``: y_1..y_a, then the correction or bonus,
then ``EMPTY`` (-1) padding.

Two implementations: ``verify_torch`` (the reference's operations batched over requests and
slots, fp64) and ``verify_triton``: a row-stats kernel over all B*(k+1) rows (max, argmax, kept
mass: ``sampler.row_stats``), then one program per request walks the k slots on scalars, reading
p_i(y_i) from a single logit, and makes two passes over one row's V for the final draw, building
the scatter of q over the vocabulary on the fly from the K candidates (no [B, k, V] tensor).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose

from .philox import keyed_uniform_torch, philox_uniform
from .sampler import (SamplingTensors, _block_v, draw_torch, filter_cuts, kept_weight, row_stats,
                      target_probs_torch)
from .triton_compat import tl, triton, use_triton

EMPTY = -1
_ACCEPT = tl.constexpr(int(Purpose.ACCEPT))
_RESIDUAL = tl.constexpr(int(Purpose.RESIDUAL))
_BONUS = tl.constexpr(int(Purpose.BONUS))


def _check_shapes(target_logits: Tensor, draft_tokens: Tensor, cand_ids: Tensor, draft_probs: Tensor) -> Tensor:
    batch, k = draft_tokens.shape
    logits = target_logits.reshape(batch, k + 1, -1) if target_logits.dim() == 2 else target_logits
    if logits.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_logits {list(target_logits.shape)}: expected [{batch}, {k + 1}, V] "
                         f"or [{batch * (k + 1)}, V]")
    if cand_ids.shape[:2] != (batch, k) or draft_probs.shape != cand_ids.shape:
        raise ValueError(f"cand_ids {list(cand_ids.shape)}, draft_probs {list(draft_probs.shape)}: "
                         f"expected both [{batch}, {k}, K]")
    return logits


def _emitted(draft_tokens: Tensor, num_accepted: Tensor, last_token: Tensor) -> Tensor:
    """y_1..y_a, the last token at a, EMPTY after  # [B, k+1]."""
    batch, k = draft_tokens.shape
    slot = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    padded = torch.cat([draft_tokens, torch.full_like(draft_tokens[:, :1], EMPTY)], dim=1)
    out = torch.where(slot < num_accepted[:, None], padded, torch.full_like(padded, EMPTY))
    return torch.where(slot == num_accepted[:, None], last_token[:, None], out)


def verify_torch(target_logits: Tensor, st: SamplingTensors, draft_tokens: Tensor, cand_ids: Tensor,
                 draft_probs: Tensor, anchor_positions: Tensor) -> tuple[Tensor, Tensor]:
    """target_logits [B, k+1, V] (or [B*(k+1), V]), draft_tokens [B, k], cand_ids/draft_probs [B, k, K],
    anchor_positions [B]. Returns num_accepted [B] long, emitted [B, k+1] long."""
    logits = _check_shapes(target_logits, draft_tokens, cand_ids, draft_probs)
    batch, k = draft_tokens.shape
    vocab = logits.shape[-1]
    rows = torch.arange(batch, device=logits.device)
    drafts = draft_tokens.long()

    argmax = torch.argmax(logits, dim=-1)  # [B, k+1]
    greedy_acc = torch.cumprod((drafts == argmax[:, :k]).long(), dim=1).sum(dim=1)

    probs = target_probs_torch(logits.reshape(batch * (k + 1), vocab), st.repeat_rows(k + 1))
    probs = probs.reshape(batch, k + 1, vocab).double()
    q = draft_probs.double()  # [B, k, K]
    total = q.sum(dim=-1)  # [B, k]
    trusted = (total > 0) & (total < torch.inf) & (q >= 0).all(dim=-1)
    q_norm = q / total[..., None]
    q_token = torch.where(cand_ids == drafts[..., None], q_norm, 0.0).sum(dim=-1)  # [B, k]
    trusted &= q_token > 0
    p_token = probs[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, k]
    accept_u = keyed_uniform_torch(st.seeds[:, None], anchor_positions[:, None], int(Purpose.ACCEPT),
                                   torch.arange(1, k + 1, device=logits.device)[None, :]).double()
    accepted = trusted & (accept_u * q_token < p_token)
    sampled_acc = torch.cumprod(accepted.long(), dim=1).sum(dim=1)  # [B]

    rejected = sampled_acc < k
    slot = sampled_acc.clamp(max=k - 1)
    p_last = probs[rows, sampled_acc]  # [B, V]
    q_vocab = torch.zeros_like(p_last).scatter_add_(-1, cand_ids[rows, slot], q_norm[rows, slot])
    residual = (p_last - q_vocab).clamp_min(0.0)
    mass = residual.sum(dim=-1)
    use_residual = rejected & trusted[rows, slot] & (mass > 0)
    weights = torch.where(use_residual[:, None], residual / mass[:, None], p_last)
    key = dict(seeds=st.seeds, positions=anchor_positions, slots=0)
    u = torch.where(rejected, keyed_uniform_torch(purpose=int(Purpose.RESIDUAL), **key),
                    keyed_uniform_torch(purpose=int(Purpose.BONUS), **key))
    sampled_token = draw_torch(weights, u)

    greedy = st.greedy
    num_accepted = torch.where(greedy, greedy_acc, sampled_acc)
    last_token = torch.where(greedy, argmax[rows, greedy_acc], sampled_token)
    return num_accepted, _emitted(drafts, num_accepted, last_token)


# -- Triton ---------------------------------------------------------------------------------------

@triton.jit
def _row_stats_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, cut_x_ptr, cut_id_ptr, max_ptr, argmax_ptr,
                      mass_ptr, ROWS_PER_REQ: tl.constexpr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    req = row // ROWS_PER_REQ
    temperature = tl.load(temperature_ptr + req)
    temperature = tl.where((temperature == 0.0) | (tl.load(top_k_ptr + req) == 1), 1.0, temperature)
    row_max, argmax, mass = row_stats(logits_ptr + row.to(tl.int64) * stride_row, temperature,
                                      tl.load(cut_x_ptr + row), tl.load(cut_id_ptr + row), VOCAB, BLOCK_V)
    tl.store(max_ptr + row, row_max)
    tl.store(argmax_ptr + row, argmax)
    tl.store(mass_ptr + row, mass)


@triton.jit
def _target_prob(row_ptr, ids, temperature, cut_x, cut_id, row_max, mass, VOCAB: tl.constexpr):
    """p at ``ids``: the kept weight over the kept mass, rounded to fp32 as the reference's probs are."""
    w = kept_weight(row_ptr, ids, temperature, cut_x, cut_id, row_max, VOCAB)
    return (w / mass).to(tl.float32).to(tl.float64)


@triton.jit
def _verify_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, seed_ptr, anchor_ptr, cut_x_ptr, cut_id_ptr,
                   max_ptr, argmax_ptr, mass_ptr, drafts_ptr, cand_ptr, dprobs_ptr, num_accepted_ptr, emitted_ptr,
                   K: tl.constexpr, KSEL: tl.constexpr, KSEL_PAD: tl.constexpr, KEYS_PAD: tl.constexpr,
                   VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    temperature = tl.load(temperature_ptr + b)
    greedy = (temperature == 0.0) | (tl.load(top_k_ptr + b) == 1)
    temperature = tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr + b)
    anchor = tl.load(anchor_ptr + b)
    offs_k = tl.arange(0, KSEL_PAD)
    in_k = offs_k < KSEL
    # every uniform of the step at once: accept_u_1..k, then residual_u, then bonus_u
    key = tl.arange(0, KEYS_PAD)
    purpose = tl.where(key < K, _ACCEPT, tl.where(key == K, _RESIDUAL, _BONUS))
    uniforms = philox_uniform(seed, anchor + 0 * key, purpose, tl.where(key < K, key + 1, 0)).to(tl.float64)

    num_acc = b * 0
    done = b * 0
    rej_trusted = b * 0
    for i in range(K):
        row = b * (K + 1) + i
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        y = tl.load(drafts_ptr + b * K + i).to(tl.int32)
        dp = tl.load(dprobs_ptr + (b * K + i) * KSEL + offs_k, mask=in_k, other=0.0).to(tl.float64)
        cid = tl.load(cand_ptr + (b * K + i) * KSEL + offs_k, mask=in_k, other=-1).to(tl.int32)
        total = tl.sum(dp, axis=0)
        bad = tl.max(tl.where(in_k & ~(dp >= 0.0), 1, 0), axis=0)
        trusted = (bad == 0) & (total > 0.0) & (total < float("inf"))
        q_y = tl.sum(tl.where(cid == y, dp / tl.where(trusted, total, 1.0), 0.0), axis=0)
        trusted = trusted & (q_y > 0.0)
        p_y = tl.sum(_target_prob(row_ptr, y + offs_k * 0, temperature, tl.load(cut_x_ptr + row),
                                  tl.load(cut_id_ptr + row), tl.load(max_ptr + row), tl.load(mass_ptr + row),
                                  VOCAB) * (offs_k == 0), axis=0)
        u = tl.sum(tl.where(key == i, uniforms, 0.0), axis=0)
        ok = tl.where(greedy, y == tl.load(argmax_ptr + row), trusted & (u * q_y < p_y))
        rej_trusted = tl.where((done == 0) & ~ok, trusted.to(tl.int32), rej_trusted)
        num_acc += tl.where((done == 0) & ok, 1, 0)
        done = tl.where(ok, done, 1)

    row = b * (K + 1) + num_acc
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    token = tl.load(argmax_ptr + row).to(tl.int32)
    if not greedy:
        rejected = num_acc < K
        slot = tl.minimum(num_acc, K - 1)
        dp = tl.load(dprobs_ptr + (b * K + slot) * KSEL + offs_k, mask=in_k, other=0.0).to(tl.float64)
        cid = tl.load(cand_ptr + (b * K + slot) * KSEL + offs_k, mask=in_k, other=-1).to(tl.int32)
        use_q = rejected & (rej_trusted == 1)
        q_norm = dp / tl.where(use_q, tl.sum(dp, axis=0), 1.0)
        cut_x, cut_id = tl.load(cut_x_ptr + row), tl.load(cut_id_ptr + row)
        row_max, mass = tl.load(max_ptr + row), tl.load(mass_ptr + row)
        offs = tl.arange(0, BLOCK_V)
        sum_r = tl.zeros([BLOCK_V], dtype=tl.float64)
        sum_p = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, VOCAB, BLOCK_V):
            ids = start + offs
            p = _target_prob(row_ptr, ids, temperature, cut_x, cut_id, row_max, mass, VOCAB)
            q = tl.sum(tl.where(cid[None, :] == ids[:, None], q_norm[None, :], 0.0), axis=1)
            sum_r += tl.where(use_q, tl.maximum(p - q, 0.0), 0.0)
            sum_p += p
        total_r = tl.sum(sum_r, axis=0)
        use_r = use_q & (total_r > 0.0)
        u = tl.sum(tl.where(key == tl.where(rejected, K, K + 1), uniforms, 0.0), axis=0)
        target = u * tl.where(use_r, total_r, tl.sum(sum_p, axis=0))
        cum = tl.zeros([1], dtype=tl.float64)
        pick = VOCAB + 0 * token
        last = -1 + 0 * token
        for start in range(0, VOCAB, BLOCK_V):
            ids = start + offs
            p = _target_prob(row_ptr, ids, temperature, cut_x, cut_id, row_max, mass, VOCAB)
            q = tl.sum(tl.where(cid[None, :] == ids[:, None], q_norm[None, :], 0.0), axis=1)
            w = tl.where(use_r, tl.maximum(p - q, 0.0), p)
            w = tl.where(ids < VOCAB, w, 0.0)
            cdf = tl.sum(cum) + tl.cumsum(w, axis=0)
            pick = tl.minimum(pick, tl.min(tl.where(cdf > target, ids, VOCAB), axis=0))
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, ids, -1), axis=0))
            cum = cum + tl.sum(w, axis=0)
        token = tl.minimum(pick, last)

    tl.store(num_accepted_ptr + b, num_acc.to(tl.int64))
    for i in range(K + 1):
        draft = tl.load(drafts_ptr + b * K + tl.minimum(i, K - 1))
        value = tl.where(i < num_acc, draft, tl.where(i == num_acc, token.to(tl.int64), -1))
        tl.store(emitted_ptr + b * (K + 1) + i, value)


def verify_triton(target_logits: Tensor, st: SamplingTensors, draft_tokens: Tensor, cand_ids: Tensor,
                  draft_probs: Tensor, anchor_positions: Tensor) -> tuple[Tensor, Tensor]:
    """``verify_torch`` by the Triton kernels (same arguments and results)."""
    logits = _check_shapes(target_logits, draft_tokens, cand_ids, draft_probs)
    batch, k = draft_tokens.shape
    vocab, ksel = logits.shape[-1], cand_ids.shape[-1]
    device = logits.device
    flat = logits.reshape(batch * (k + 1), vocab)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    cut_x, cut_id = filter_cuts(flat, st.repeat_rows(k + 1))
    rows = batch * (k + 1)
    row_max = torch.empty(rows, dtype=torch.float32, device=device)
    row_argmax = torch.empty(rows, dtype=torch.int32, device=device)
    row_mass = torch.empty(rows, dtype=torch.float64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty((batch, k + 1), dtype=torch.int64, device=device)
    if batch == 0:
        return num_accepted, emitted
    block_v = _block_v(vocab)
    _row_stats_kernel[(rows,)](flat, flat.stride(0), st.temperature, st.top_k, cut_x, cut_id, row_max, row_argmax,
                               row_mass, ROWS_PER_REQ=k + 1, VOCAB=vocab, BLOCK_V=block_v)
    _verify_kernel[(batch,)](flat, flat.stride(0), st.temperature, st.top_k, st.seeds,
                             anchor_positions.to(torch.int64).contiguous(), cut_x, cut_id, row_max, row_argmax,
                             row_mass, draft_tokens.to(torch.int64).contiguous(),
                             cand_ids.to(torch.int64).contiguous(), draft_probs.contiguous(), num_accepted,
                             emitted, K=k, KSEL=ksel, KSEL_PAD=max(2, triton.next_power_of_2(ksel)),
                             KEYS_PAD=triton.next_power_of_2(k + 2), VOCAB=vocab,
                             BLOCK_V=block_v)
    return num_accepted, emitted


def verify(target_logits: Tensor, st: SamplingTensors, draft_tokens: Tensor, cand_ids: Tensor, draft_probs: Tensor,
           anchor_positions: Tensor) -> tuple[Tensor, Tensor]:
    """The engine's entry point: Triton on CUDA, torch elsewhere."""
    fn = verify_triton if use_triton(target_logits) else verify_torch
    return fn(target_logits, st, draft_tokens, cand_ids, draft_probs, anchor_positions)
