"""DFlash 2 as a Proposer: context rows into the ring, one block forward, the selector walk.

After every target forward (prefill or verify) over rows at positions P:

    c_P = context_rows(taps_P)                  [T, C]   RMSNorm(W_fc [taps of target_layer_ids])
    k_P, v_P = context_kv(c_P, P)               [L, T, Hkv, D] each, keys post-RoPE
    ring.write(P, [k_P, v_P])                   all rows, before acceptance is known

A verify's rejected rows (positions past the new frontier) are written too; they are never read,
because the next anchor's readable window ends before them (``reference/speculative/ring.py`` proves it), and
the next verify overwrites them. To propose at anchor t0, position s:

    ring.read(s)           positions s-W+1 .. s-1 with their K/V (a stale slot raises)
    forward_block          rows [t0, mask x (B-1)] at s .. s+B-1, always the full block
    select                 the walk over the top-K_sel candidates, stopping after k slots

The selector is greedy (argmax) for greedy requests, else it samples slot i from
q_i = softmax(sigma_i / T) with ``rng.uniform(seed, s, SELECTOR, i)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..model.draft import ReferenceDraft
from .proposer import Proposal, Proposer
from .ring import Ring
from ..request.sampling_params import SamplingParams
from .selector import CandidateSelector, select, selector_uniforms
from ..model.target import TargetOutput


class DFlashProposer(Proposer):
    def __init__(self, draft: ReferenceDraft):
        cfg = draft.cfg
        self.draft = draft
        self.selector = CandidateSelector.from_draft(cfg, draft.w)
        # one ring row per position: K and V of every draft layer  # [L, 2, Hkv, D]
        self.ring = Ring(cfg.sliding_window, (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim))

    def observe(self, tokens: Sequence[int], first_position: int, target_out: TargetOutput,
                num_committed: int) -> None:
        positions = torch.arange(first_position, first_position + len(tokens))  # [T]
        rows = self.draft.context_rows(target_out.taps)  # [T, C]
        keys, values = self.draft.context_kv(rows, positions)  # [L, T, Hkv, D] each
        self.ring.write(positions, torch.stack([keys, values], dim=2).transpose(0, 1))  # [T, L, 2, Hkv, D]

    def propose(self, anchor_token: int, anchor_position: int, k: int, params: SamplingParams) -> Proposal:
        positions, rows = self.ring.read(anchor_position)  # [N], [N, L, 2, Hkv, D]
        ctx_k, ctx_v = rows[:, :, 0].transpose(0, 1), rows[:, :, 1].transpose(0, 1)  # [L, N, Hkv, D]
        block = self.draft.forward_block(anchor_token, anchor_position, positions, ctx_k, ctx_v)
        uniforms = None if params.greedy else selector_uniforms(params.seed, anchor_position, k)
        walk = select(block, self.selector, anchor_token, k, params.temperature, uniforms)
        return Proposal(walk.tokens, walk.cand_ids, walk.draft_probs)
