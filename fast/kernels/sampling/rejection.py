"""Batched verification of k drafts per request, twin of ``reference/speculative/verify.py``.

For each request b (target rows b*(k+1) + i, row i giving p_{i+1}), with the request's sampling
parameters and the filtered target distribution computed in place from the logits
(``sampler``: w on the kept set, p = w / Z):

- greedy requests: the longest prefix with y_i = argmax(row i-1) (lowest id on ties), then the
  argmax of the first mismatching row (or of row k);
- sampled requests (sparse-q rejection): slot i's q row is ``draft_probs [K]`` over
  ``cand_ids [K]``. A row that is NaN/inf anywhere, has a negative entry, sums to 0 or gives y_i
  no mass is untrusted: the slot is rejected and its token drawn from p_i. Otherwise it is divided
  by its total and y_i is accepted iff ``accept_u_i * q_i(y_i) < fl32(p_i(y_i))`` (fp64; p rounded
  to fp32 as the reference's probabilities are). At the first rejection the token is drawn from
  ``max(0, p - q)`` (fp64; from p if that has no mass, or if the row was untrusted) with
  residual_u; after k acceptances a bonus from p_{k+1} with bonus_u.
  Uniforms: ``uniform(seed, s, ACCEPT, i)``, ``(seed, s, RESIDUAL, 0)``, ``(seed, s, BONUS, 0)``.

Outputs: ``num_accepted [B]`` and ``emitted [B, k+1]``: y_1..y_a, then the correction or bonus,
then ``EMPTY`` (-1) padding.

``limits [B]`` (optional): request b verifies only its first ``limits[b] <= k`` drafts, exactly as a
verify of ``limits[b]`` drafts would (the same keys; rows and drafts past ``limits[b]`` do not change the result), the bonus
after them drawn from p_{limits[b]+1}. A step whose requests draft different k (one near its max_tokens
drafts fewer) so runs one launch shape, and a captured step replays it.

Two implementations: ``verify_torch`` (the reference's operations batched over requests and
slots, fp64, on ``row_filter.kept_weights_torch``) and ``verify_triton``: ``row_filter.filter_triton``
over all B*(k+1) rows (max, argmax, cut, kept mass), then one program per request walks the k
slots on scalars, reading p_i(y_i) from a single logit, and ``sampler._draw_kernel`` makes the final
draw over (request, chunk) programs, building the scatter of q over the vocabulary on the fly from
the K candidates (no [B, k, V] tensor). In both, a batch the host knows is all greedy
(``SamplingTensors.all_greedy``) is one argmax pass and the prefix match: no filter, no uniforms.
No launch waits on the host (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.request.rng import Purpose

from .philox import keyed_uniform_torch, philox_uniform
from .row_filter import DEFAULT_CONFIG, FilterConfig, Layout, filter_triton, kept_weights_torch, row_params
from .sampler import SamplingTensors, VerifyDraws, draw_torch, launch_draws
from ..common.dispatch import GpuForm, KernelOp
from ..common.triton_compat import tl, triton

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
                 draft_probs: Tensor, anchor_positions: Tensor, limits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """target_logits [B, k+1, V] (or [B*(k+1), V]), draft_tokens [B, k], cand_ids/draft_probs [B, k, K],
    anchor_positions [B], limits [B] (drafts verified per request, 0..k; None: k). Returns num_accepted [B]
    long, emitted [B, k+1] long."""
    logits = _check_shapes(target_logits, draft_tokens, cand_ids, draft_probs)
    batch, k = draft_tokens.shape
    vocab = logits.shape[-1]
    rows = torch.arange(batch, device=logits.device)
    drafts = draft_tokens.long()
    limit = torch.full((batch,), k, device=logits.device) if limits is None else limits.long().clamp(0, k)

    argmax = torch.argmax(logits, dim=-1)  # [B, k+1]
    greedy_acc = torch.minimum(torch.cumprod((drafts == argmax[:, :k]).long(), dim=1).sum(dim=1), limit)
    if st.all_greedy:  # the host knows no request samples: no filter, no draws (as verify_triton)
        return greedy_acc, _emitted(drafts, greedy_acc, argmax[rows, greedy_acc])

    weights = kept_weights_torch(logits.reshape(batch * (k + 1), vocab), st, rows_per_request=k + 1)[1]
    probs = weights.reshape(batch, k + 1, vocab)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # fp64
    q = draft_probs.double()  # [B, k, K]
    total = q.sum(dim=-1)  # [B, k]
    trusted = (total > 0) & (total < torch.inf) & (q >= 0).all(dim=-1)
    q_norm = q / total[..., None]
    q_token = torch.where(cand_ids == drafts[..., None], q_norm, 0.0).sum(dim=-1)  # [B, k]
    trusted &= q_token > 0
    p_token = probs[:, :k].gather(-1, drafts[..., None])[..., 0].float().double()  # [B, k], as fp32 probabilities
    accept_u = keyed_uniform_torch(st.seeds[:, None], anchor_positions[:, None], int(Purpose.ACCEPT),
                                   torch.arange(1, k + 1, device=logits.device)[None, :]).double()
    accepted = trusted & (accept_u * q_token < p_token)
    sampled_acc = torch.minimum(torch.cumprod(accepted.long(), dim=1).sum(dim=1), limit)  # [B]

    rejected = sampled_acc < limit
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
def _verify_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, anchor_ptr, m_ptr,
                   argmax_ptr, cut_x_ptr, cut_id_ptr, z_ptr, z_stride, drafts_ptr, cand_ptr, dprobs_ptr,
                   num_accepted_ptr, emitted_ptr, draw_row_ptr, use_q_ptr, u_ptr, draw_slot_ptr, out_index_ptr,
                   limits_ptr, K: tl.constexpr, KSEL: tl.constexpr, KSEL_PAD: tl.constexpr, KEYS_PAD: tl.constexpr,
                   VOCAB: tl.constexpr, GREEDY_ONLY: tl.constexpr, HAS_LIMITS: tl.constexpr):
    """Request b's walk over its k slots (its first ``limits[b]`` with HAS_LIMITS); a sampled request leaves
    its final draw to ``_draw_kernel``."""
    b = tl.program_id(0)
    limit = b * 0 + K
    if HAS_LIMITS:
        limit = tl.minimum(tl.load(limits_ptr + b).to(tl.int32), K)
    temperature, greedy, k_on, p_on, top_k, top_p = row_params(temperature_ptr, top_k_ptr, top_p_ptr, b, VOCAB)
    num_acc = b * 0
    done = b * 0
    rej_trusted = b * 0
    if not GREEDY_ONLY:
        offs_k = tl.arange(0, KSEL_PAD)
        in_k = offs_k < KSEL
        # every uniform of the step at once: accept_u_1..k, then residual_u, then bonus_u
        key = tl.arange(0, KEYS_PAD)
        purpose = tl.where(key < K, _ACCEPT, tl.where(key == K, _RESIDUAL, _BONUS))
        uniforms = philox_uniform(tl.load(seed_ptr + b), tl.load(anchor_ptr + b) + 0 * key, purpose,
                                  tl.where(key < K, key + 1, 0)).to(tl.float64)
    for i in tl.static_range(K):  # unrolled: every slot's loads issue at once, only the decisions chain
        row = b * (K + 1) + i
        y = tl.load(drafts_ptr + b * K + i)
        ok = (y == tl.load(argmax_ptr + row)) & (i < limit)
        if not GREEDY_ONLY:
            dp = tl.load(dprobs_ptr + (b * K + i) * KSEL + offs_k, mask=in_k, other=0.0).to(tl.float64)
            cid = tl.load(cand_ptr + (b * K + i) * KSEL + offs_k, mask=in_k, other=-1)
            total = tl.sum(dp, axis=0)
            bad = tl.max(tl.where(in_k & ~(dp >= 0.0), 1, 0), axis=0)
            trusted = (bad == 0) & (total > 0.0) & (total < float("inf"))
            q_y = tl.sum(tl.where(cid == y, dp / tl.where(trusted, total, 1.0), 0.0), axis=0)
            trusted = trusted & (q_y > 0.0)
            x_y = tl.math.div_rn(tl.load(logits_ptr + row.to(tl.int64) * stride_row + y).to(tl.float32), temperature)
            cut_x = tl.load(cut_x_ptr + row)
            kept = (x_y > cut_x) | ((x_y == cut_x) & (y <= tl.load(cut_id_ptr + row)))
            w_y = tl.exp(x_y.to(tl.float64) - tl.load(m_ptr + row).to(tl.float64))
            # p(y) rounded to fp32, as the reference's probabilities are
            p_y = tl.where(kept, (w_y / tl.load(z_ptr + row * z_stride)).to(tl.float32).to(tl.float64), 0.0)
            u = tl.sum(tl.where(key == i, uniforms, 0.0), axis=0)
            ok = tl.where(greedy, ok, trusted & (u * q_y < p_y) & (i < limit))
            rej_trusted = tl.where((done == 0) & ~ok, trusted.to(tl.int32), rej_trusted)
        num_acc += tl.where((done == 0) & ok, 1, 0)
        done = tl.where(ok, done, 1)

    row = b * (K + 1) + num_acc
    token = tl.load(argmax_ptr + row)
    tl.store(num_accepted_ptr + b, num_acc.to(tl.int64))
    if not GREEDY_ONLY:
        rejected = num_acc < limit
        tl.store(draw_row_ptr + b, tl.where(greedy, -1, row).to(tl.int64))
        tl.store(use_q_ptr + b, (rejected & (rej_trusted == 1)).to(tl.int32))
        tl.store(u_ptr + b, tl.sum(tl.where(key == tl.where(rejected, K, K + 1), uniforms, 0.0), axis=0))
        tl.store(draw_slot_ptr + b, tl.minimum(num_acc, K - 1).to(tl.int64))
        tl.store(out_index_ptr + b, (b * (K + 1) + num_acc).to(tl.int64))
    for i in range(K + 1):
        draft = tl.load(drafts_ptr + b * K + tl.minimum(i, K - 1))
        value = tl.where(i < num_acc, draft, tl.where(i == num_acc, token, -1))
        tl.store(emitted_ptr + b * (K + 1) + i, value)


def verify_triton(target_logits: Tensor, st: SamplingTensors, draft_tokens: Tensor, cand_ids: Tensor,
                  draft_probs: Tensor, anchor_positions: Tensor, limits: Tensor | None = None,
                  config: FilterConfig = DEFAULT_CONFIG) -> tuple[Tensor, Tensor]:
    """``verify_torch`` by the Triton kernels (same arguments and results)."""
    logits = _check_shapes(target_logits, draft_tokens, cand_ids, draft_probs)
    batch, k = draft_tokens.shape
    vocab, ksel = logits.shape[-1], cand_ids.shape[-1]
    device = logits.device
    flat = logits.reshape(batch * (k + 1), vocab)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty((batch, k + 1), dtype=torch.int64, device=device)
    if batch == 0:
        return num_accepted, emitted
    drafts = draft_tokens.to(torch.int64).contiguous()
    anchors = anchor_positions.to(torch.int64).contiguous()
    keys_pad = triton.next_power_of_2(k + 2)
    has_limits = limits is not None
    limits = limits.to(torch.int64).contiguous() if has_limits else anchors  # unread without HAS_LIMITS
    if st.all_greedy:
        argmax = torch.argmax(flat, dim=-1)
        unused = argmax
        _verify_kernel[(batch,)](flat, flat.stride(0), st.temperature, st.top_k, st.top_p, st.seeds, anchors, unused,
                                 argmax, unused, unused, unused, 1, drafts, unused, unused, num_accepted, emitted,
                                 unused, unused, unused, unused, unused, limits, K=k, KSEL=1, KSEL_PAD=2,
                                 KEYS_PAD=keys_pad, VOCAB=vocab, GREEDY_ONLY=True, HAS_LIMITS=has_limits)
        return num_accepted, emitted
    flt = filter_triton(flat, st, rows_per_request=k + 1, config=config)
    cand = cand_ids.to(torch.int64).contiguous()
    dprobs = draft_probs.contiguous()
    draw_row = torch.empty(batch, dtype=torch.int64, device=device)
    use_q = torch.empty(batch, dtype=torch.int32, device=device)
    u = torch.empty(batch, dtype=torch.float64, device=device)
    draw_slot = torch.empty(batch, dtype=torch.int64, device=device)
    out_index = torch.empty(batch, dtype=torch.int64, device=device)
    _verify_kernel[(batch,)](flat, flat.stride(0), st.temperature, st.top_k, st.top_p, st.seeds, anchors, flt.row_max,
                             flt.argmax, flt.cut_x, flt.cut_id, flt.z_kept, flt.z_kept.stride(0), drafts, cand, dprobs,
                             num_accepted, emitted, draw_row, use_q, u, draw_slot, out_index, limits, K=k,
                             KSEL=ksel, KSEL_PAD=max(2, triton.next_power_of_2(ksel)), KEYS_PAD=keys_pad, VOCAB=vocab,
                             GREEDY_ONLY=False, HAS_LIMITS=has_limits)
    launch_draws(flat, st, flt, Layout.of(vocab, config), emitted,
                 verify=VerifyDraws(draw_row, use_q, u, draw_slot, out_index, cand, dprobs))
    return num_accepted, emitted


verify = KernelOp("rejection", verify_torch, GpuForm(verify_triton))
