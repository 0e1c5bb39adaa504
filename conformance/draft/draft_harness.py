"""Shared pieces of the DFlash and MTP proposer conformance: errors against the tolerance table,
target-side inputs, and reference runs with their near-tie margins.

:class:`ErrorLog` keeps the largest NUMERIC error per quantity so the suite reports the fraction
of the fp32 bound it used (printed in the terminal summary by conftest.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.model.draft import ReferenceDraft
from dflash2.reference.speculative.selector import CandidateSelector, SelectorOutput, select, selector_uniforms

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the fast side runs
NUMERIC_FP32 = 1e-5  # docs/tolerances.md: NUMERIC, fp32
NEAR_TIE_FP32 = 1e-4  # docs/tolerances.md: near-tie logit gap, fp32
DRAW_MARGIN = 1e-5  # a sampled pick's u * sum(q) this far from every CDF step is not a near tie


def rms_rel(a: Tensor, b: Tensor) -> float:
    """``rms(a - b) / rms(b)`` in float64."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp(min=1e-300))


class ErrorLog:
    """The largest rms-relative error per quantity; ``add`` asserts the bound and finiteness."""

    def __init__(self, name: str, bound: float = NUMERIC_FP32):
        self.name, self.bound = name, bound
        self.max_error: dict[str, float] = {}

    def add(self, quantity: str, fast: Tensor, reference: Tensor) -> None:
        assert fast.shape == reference.shape, f"{self.name} {quantity}: {list(fast.shape)} vs {list(reference.shape)}"
        assert torch.isfinite(fast).all(), f"{self.name} {quantity}: non-finite values (a read of unwritten memory?)"
        error = rms_rel(fast, reference)
        assert error <= self.bound, f"{self.name} {quantity}: rms-rel {error:.2e} > {self.bound:g}"
        self.max_error[quantity] = max(self.max_error.get(quantity, 0.0), error)

    def lines(self) -> list[str]:
        return [f"{self.name} {q}: max rms-rel {e:.2e} = {e / self.bound:.1%} of {self.bound:g}"
                for q, e in sorted(self.max_error.items())]


REPORT: list[ErrorLog] = []


def new_log(name: str) -> ErrorLog:
    """The reported log of this name (one per name across the session)."""
    for log in REPORT:
        if log.name == name:
            return log
    REPORT.append(ErrorLog(name))
    return REPORT[-1]


def random_taps(num_layers: int, rows: int, hidden: int, gen: torch.Generator) -> tuple[Tensor, ...]:
    """Target residual rows of every layer (what ``TargetOutput.taps`` holds)  # L x [T, C]."""
    return tuple(3.0 * torch.randn(rows, hidden, generator=gen) for _ in range(num_layers))


def features_of(taps: tuple[Tensor, ...], layer_ids: tuple[int, ...]) -> Tensor:
    """The fast side's input: the tapped layers concatenated in target_layer_ids order  # [T, m*C]."""
    return torch.cat([taps[i] for i in layer_ids], dim=-1)


def reference_block_layers(draft: ReferenceDraft, anchor_token: int, anchor_position: int, ctx_positions: Tensor,
                           ctx_k: Tensor, ctx_v: Tensor) -> list[Tensor]:
    """Each layer's output ``[S, C]`` of ``ReferenceDraft.forward_block``, layer by layer (same code path)."""
    positions = anchor_position + torch.arange(draft.cfg.block_size)
    x = draft.embed[draft.block_tokens(anchor_token)]
    outputs = []
    for layer in range(draft.cfg.num_hidden_layers):
        x = draft._layer(layer, x, positions, ctx_k[layer], ctx_v[layer], ctx_positions)
        outputs.append(x)
    return outputs


def reference_walk(draft: ReferenceDraft, selector: CandidateSelector, ring, anchor_token: int,
                   anchor_position: int, k: int, params) -> tuple[SelectorOutput, object]:
    """The reference proposer's steps (ring read, block, walk), keeping the block and sigma."""
    positions, rows = ring.read(anchor_position)
    block = draft.forward_block(anchor_token, anchor_position, positions, rows[:, :, 0].transpose(0, 1),
                                rows[:, :, 1].transpose(0, 1))
    uniforms = None if params.greedy else selector_uniforms(params.seed, anchor_position, k)
    return select(block, selector, anchor_token, k, params.temperature, uniforms), block


def first_near_tie(walk: SelectorOutput, block, params, anchor_position: int, top_k: int) -> int:
    """The first slot (0-based; k if none) whose outcome the reference decides by a near tie.

    A slot is a near tie when two of its K_sel + 1 largest logits are within the fp32 near-tie gap
    (the candidate set or order could flip), when its top two edge scores are (greedy), or when
    u * sum(q) lies within DRAW_MARGIN of a CDF step (sampled). Before that slot, the fast walk
    must agree EXACTLY (the TOKEN_STREAM rule of docs/tolerances.md, per slot).
    """
    k = walk.tokens.shape[0]
    uniforms = None if params.greedy else selector_uniforms(params.seed, anchor_position, k)
    for i in range(k):
        top = torch.sort(block.logits[i].float(), descending=True).values[:top_k + 1]
        if bool(((top[:-1] - top[1:]) <= NEAR_TIE_FP32).any()):
            return i
        if uniforms is None:
            top2 = torch.topk(walk.sigma[i], 2).values
            if float(top2[0] - top2[1]) <= NEAR_TIE_FP32:
                return i
        else:
            cdf = torch.cumsum(walk.draft_probs[i].double(), 0)
            if float((cdf - uniforms[i] * cdf[-1]).abs().min()) <= DRAW_MARGIN:
                return i
    return k
