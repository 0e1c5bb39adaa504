"""DFlash 2 as a Proposer: context rows into the ring, one block forward, the selector walk.

After every target forward (prefill or verify) over rows at positions P:

    c_P = context_rows(taps_P)                  [T, C]   RMSNorm(W_fc [taps of target_layer_ids])
    window.write(P, c_P)                        the dflash_window: what a prefix-cache snapshot keeps
    k_P, v_P = context_kv(c_P, P)               [L, T, Hkv, D] each, keys post-RoPE, one row at a time
    ring.write(P, [k_P, v_P])                   all rows, before acceptance is known

A verify's rejected rows (positions past the new frontier) are written too; they are never read,
because the next anchor's readable window ends before them (``reference/speculative/ring.py`` proves it), and
the next verify overwrites them. To propose at anchor t0, position s:

    ring.read(s)           positions s-W+1 .. s-1 with their K/V (a stale slot raises)
    forward_block          rows [t0, mask x (B-1)] at s .. s+B-1, always the full block
    select                 the walk over the top-K_sel candidates, stopping after k slots

The selector is greedy (argmax) for greedy requests, else it samples slot i from
q_i = softmax(sigma_i / T) with ``rng.uniform(seed, s, SELECTOR, i)``.

Prefix cache (``reference/speculative/prefix.py``). A snapshot at frontier f keeps the window's
rows c_p for p = max(0, f-W+1) .. f-1 (C floats a row, not the ring's L * 2 * Hkv * D); a restore
rebuilds both rings from them, projecting each row again. The projection goes one row at a time
so a row's K/V do not depend on the rows that share its call: one matmul over T rows does (MKL
takes another kernel below 4 rows, measured with torch 2.13 on CPU), and a ring rebuilt from W-1
rows at once would then differ in the last bits from one written by 2-row verifies.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ..model.draft import ReferenceDraft
from .proposer import Proposal, Proposer
from .ring import Ring
from ..request.sampling_params import SamplingParams
from .selector import CandidateSelector, select, selector_uniforms
from ..model.target import TargetOutput


class ContextWindow(NamedTuple):
    """A DFlash snapshot at frontier f: the context rows of positions max(0, f-W+1) .. f-1."""

    positions: Tensor  # [N] long, consecutive, N = min(f, W-1)
    rows: Tensor  # [N, C] c_p, after fc and hidden_norm


class DFlashProposer(Proposer):
    def __init__(self, draft: ReferenceDraft):
        cfg = draft.cfg
        self.draft = draft
        self.selector = CandidateSelector.from_draft(cfg, draft.w)
        # one ring row per position: K and V of every draft layer  # [L, 2, Hkv, D]
        self.ring = Ring(cfg.sliding_window, (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim))
        # the dflash_window: the context row c_p itself per position, kept only for snapshots  # [C]
        self.window = Ring(cfg.sliding_window, (cfg.hidden_size,))

    def observe(self, tokens: Sequence[int], first_position: int, target_out: TargetOutput,
                num_committed: int) -> None:
        positions = torch.arange(first_position, first_position + len(tokens))  # [T]
        rows = self.draft.context_rows(target_out.taps)  # [T, C]
        self.window.write(positions, rows)
        self.ring.write(positions, self.ring_rows(rows, positions))

    def ring_rows(self, rows: Tensor, positions: Tensor) -> Tensor:
        """K/V ring rows of context rows ``c [T, C]`` at ``positions [T]``, each row projected on its own
        (the module docstring says why)  # -> [T, L, 2, Hkv, D]."""
        out = []
        for i in range(rows.shape[0]):
            keys, values = self.draft.context_kv(rows[i:i + 1], positions[i:i + 1])  # [L, 1, Hkv, D] each
            out.append(torch.stack([keys, values], dim=1)[:, :, 0])  # [L, 2, Hkv, D]
        return torch.stack(out) if out else torch.empty((0, *self.ring.row_shape))

    def snapshot(self, frontier: int) -> ContextWindow:
        positions, rows = self.window.read(frontier)  # max(0, f-W+1) .. f-1; a stale slot raises
        return ContextWindow(positions, rows)

    def restore(self, state: object) -> None:
        """Rebuild the window and the ring from the snapshot's rows: a read at f then equals the live ring's."""
        if not isinstance(state, ContextWindow):
            raise ValueError(f"a DFlash restore needs a ContextWindow, got {type(state).__name__} (a snapshot "
                             "taken by another kind of proposer?)")
        self.window.rebuild(state.positions, state.rows)
        self.ring.rebuild(state.positions, self.ring_rows(state.rows, state.positions))

    def propose(self, anchor_token: int, anchor_position: int, k: int, params: SamplingParams) -> Proposal:
        positions, rows = self.ring.read(anchor_position)  # [N], [N, L, 2, Hkv, D]
        ctx_k, ctx_v = rows[:, :, 0].transpose(0, 1), rows[:, :, 1].transpose(0, 1)  # [L, N, Hkv, D]
        block = self.draft.forward_block(anchor_token, anchor_position, positions, ctx_k, ctx_v)
        uniforms = None if params.greedy else selector_uniforms(params.seed, anchor_position, k)
        walk = select(block, self.selector, anchor_token, k, params.temperature, uniforms)
        return Proposal(walk.tokens, walk.cand_ids, walk.draft_probs)
