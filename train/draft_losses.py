"""The losses that train a DFlash 2 draft and fine-tune the MTP head against a frozen target.

Notation: a window x_0 .. x_{T-1}; the frozen target's log-probabilities log p_t (the row at t
predicts x_{t+1}, given the data prefix x_{<=t}); B the block size; w_i = exp(-(i-1)/gamma) the
DFlash paper's position decay (later slots are reached less often, so they weigh less).

Draft, one block per anchor s (1 <= s <= T-B): block rows 0..B-1 at positions s+i read
[x_s, mask, ...]; row i >= 1 gives unary logits z_i and predicts the token at s+i, whose target
distribution is p_{s+i-1} (self-distillation: the target's own next-token law, not the corpus
token, is what verification compares against)::

    L_block    = sum_i w_i * CE(p_{s+i-1}, softmax z_i) / sum_i w_i
    L_selector = sum_i w_i * CE(p~_i, softmax sigma_i) / sum_i w_i
      C_i = top-K_sel(z_i);  sigma_i[j] = z_i[C_i[j]] + <A[x_{s+i-1}] * P h_i, Bc[C_i[j]]>
      p~_i = p_{s+i-1} restricted to C_i and renormalised  (slots whose C_i holds no mass are skipped)

The selector walk at inference conditions slot i on its predecessor token; in training the
predecessor is the data token x_{s+i-1} (teacher forcing), the one that an accepted path through
the data would have put there.

MTP chain of J steps (teacher-forced, unrolled through the head's own hidden states)::

    step j = 1..J: row t reads (h^{j-1}_t, x_{t+j}) at position t+j-1 and predicts x_{t+j+1};
    h^0 = the target's final hidden;  L_mtp = sum_j w_j * CE(p_{t+j}, softmax mtp_logits^j_t) / sum_j w_j

which is how the served chain runs (reference/speculative/mtp.py), except that each step's
attention reads that step's rows rather than the first step's cached pairs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def decay_weights(count: int, gamma: float, device: torch.device) -> Tensor:
    """``[count]``: w_i = exp(-(i-1)/gamma) for i = 1..count."""
    return torch.exp(-torch.arange(count, device=device, dtype=torch.float32) / gamma)


def soft_cross_entropy(target_logp: Tensor, logits: Tensor) -> Tensor:
    """``-sum_v p(v) log softmax(logits)(v)`` over the last axis, in fp32."""
    return -(target_logp.float().exp() * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def sample_anchors(num_seqs: int, seq_len: int, count: int, block_size: int, generator: torch.Generator,
                   device: torch.device, low: int = 1) -> Tensor:
    """``[N, A]`` distinct anchor positions per sequence in ``low .. T-B``, sorted."""
    span = seq_len - block_size - low + 1  # anchors low..T-B
    if count > span:
        raise ValueError(f"anchors_per_seq={count}: a window of {seq_len} tokens has only {span} anchors in "
                         f"{low} .. {seq_len - block_size} for block {block_size}")
    scores = torch.rand(num_seqs, span, generator=generator)
    return (scores.topk(count, dim=1).indices.sort(dim=1).values + low).to(device)


def block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """``[N, A, B-1]``: the target rows t = s+i-1 whose distributions label slots i = 1..B-1."""
    return anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)


def gather_rows(rows: Tensor, positions: Tensor) -> Tensor:
    """``rows [N, T, ...]`` at ``positions [N, A, S]`` -> ``[N, A, S, ...]``."""
    n, a, s = positions.shape
    flat = positions.reshape(n, a * s)
    picked = torch.gather(rows, 1, flat.reshape(n, a * s, *([1] * (rows.ndim - 2))).expand(n, a * s, *rows.shape[2:]))
    return picked.reshape(n, a, s, *rows.shape[2:])


def draft_losses(draft, hidden: Tensor, lm_head: Tensor, target_logp: Tensor, prev_ids: Tensor, gamma: float,
                 top_k: int) -> tuple[Tensor, Tensor, dict]:
    """Block and selector losses of one batch, and teacher-forced agreement figures (detached tensors,
    so the step does not wait on the host; :func:`to_python` reads them when logging).

    hidden: ``[N, A, B, C]`` the draft's final hidden; lm_head ``[V, C]`` (frozen);
    target_logp: ``[N, A, B-1, V]`` log p at rows s+i-1; prev_ids: ``[N, A, B-1]`` x_{s+i-1}.
    """
    slots = hidden.shape[2] - 1
    w = decay_weights(slots, gamma, hidden.device)  # [B-1]
    z = hidden[:, :, 1:] @ lm_head.T  # [N, A, B-1, V]
    block = (soft_cross_entropy(target_logp, z).mean(dim=(0, 1)) * w).sum() / w.sum()

    cand_logits, cand_ids = z.topk(top_k, dim=-1)  # [N, A, B-1, K]
    sigma = draft.selector_scores(hidden[:, :, 1:], cand_ids, cand_logits, prev_ids)  # [N, A, B-1, K]
    cand_p = target_logp.float().exp().gather(-1, cand_ids)  # [N, A, B-1, K]
    mass = cand_p.sum(-1)  # [N, A, B-1]
    usable = mass > 1e-6
    per_slot = -(cand_p / mass.clamp_min(1e-12)[..., None] * F.log_softmax(sigma.float(), dim=-1)).sum(-1)
    per_slot = torch.where(usable, per_slot, torch.zeros_like(per_slot))
    selector = ((per_slot.sum(dim=(0, 1)) / usable.sum(dim=(0, 1)).clamp_min(1)) * w).sum() / w.sum()

    with torch.no_grad():
        greedy_target = target_logp.argmax(-1)  # [N, A, B-1]
        picked = cand_ids.gather(-1, sigma.argmax(-1, keepdim=True)).squeeze(-1)
        match = (picked == greedy_target).float()  # selector's pick vs the target's argmax, per slot
        accepted = match.cumprod(dim=-1).sum(-1)  # teacher-forced accepted drafts per block
        figures = {"draft_block_loss": block.detach(), "selector_loss": selector.detach(),
                   "slot_match": match.mean(dim=(0, 1)),
                   "unary_match_slot1": (z[:, :, 0].argmax(-1) == greedy_target[:, :, 0]).float().mean(),
                   "cand_mass": mass.mean(), "tf_accepted": accepted.mean()}
    return block, selector, figures


def mtp_chain_loss(target, hidden: Tensor, inputs: Tensor, target_logp: Tensor, steps: int,
                   gamma: float) -> tuple[Tensor, dict]:
    """L_mtp over ``steps`` unrolled steps. hidden ``[N, T, C]`` (frozen target), inputs ``[N, T]``,
    target_logp ``[N, T, V]``."""
    t = inputs.shape[1]
    w = decay_weights(steps, gamma, hidden.device)
    h, total, figures = hidden, hidden.new_zeros((), dtype=torch.float32), {}
    for j in range(1, steps + 1):
        h, logits = target.mtp_forward(h[:, : t - j], inputs[:, j:], position_offset=j - 1)  # rows t: x_{t+j+1}
        label = target_logp[:, j:]  # [N, T-j, V]: row t+j predicts x_{t+j+1}
        step_loss = soft_cross_entropy(label, logits).mean()
        total = total + w[j - 1] * step_loss
        with torch.no_grad():
            figures[f"mtp_step{j}_match"] = (logits.argmax(-1) == label.argmax(-1)).float().mean()
    figures["mtp_loss"] = (total / w.sum()).detach()
    return total / w.sum(), figures


def to_python(figures: dict) -> dict:
    """Detached tensors -> rounded floats (lists for vectors): one host read, at log time only."""
    out = {}
    for name, value in figures.items():
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        out[name] = [round(v, 4) for v in value] if isinstance(value, list) else round(float(value), 4)
    return out


def expected_tokens_per_step(slot_match: list[float]) -> float:
    """1 + sum_i prod_{j<=i} m_j if slot matches were independent: a rough, teacher-forced gauge."""
    return 1.0 + sum(math.prod(slot_match[: i + 1]) for i in range(len(slot_match)))
