"""Floors: the least time a step can take on this device, from the bytes it must move.

A decode or verify step at small batch is memory bound: every weight it uses is read once, and
the caches it touches are read (and the GDN state written). The floor of a step is

    floor = bytes(step) / copy bandwidth

with the bandwidth measured in the same run (``bench/measure.copy_bandwidth``: a device-to-device
copy, counting bytes read plus bytes written), so a slow or shared card lowers its own floor. Bytes per step:

- target weights: every tensor of the forward except the embedding table (one row is read) and the
  MTP head; for an MoE, the routed experts count by the expected number of distinct experts that R
  rows touch, ``E * (1 - (1 - k/E)^R)`` per layer (independent uniform routing; random weights
  route close to that);
- MTP: the MTP layer and the LM head once per chained draft;
- DFlash: the draft's layers once, its LM-head logits for the block (the target's head read again),
  the selector's hidden projection;
- caches: each sequence's K/V context per full-attention layer, the GDN recurrent state read and
  written per linear-attention layer, bytes in the cache dtype.

The floor counts no activation traffic and no arithmetic, so it is a bound no engine reaches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.formats.draft_checkpoint import expected_draft_shapes
from dflash2.reference.formats.draft_config import DraftConfig
from dflash2.reference.formats.weights import expected_target_shapes

EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def expected_distinct_experts(num_experts: int, top_k: int, rows: int) -> float:
    """E[distinct experts] among ``rows`` independent uniform top-k routings."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


@dataclass(frozen=True)
class StepBytes:
    weights: float
    caches: float

    @property
    def total(self) -> float:
        return self.weights + self.caches


def target_step_bytes(cfg: TargetConfig, itemsize: int, *, num_seqs: int, rows_per_seq: int,
                      context: int) -> StepBytes:
    """Bytes one target step over ``num_seqs`` sequences of ``rows_per_seq`` rows must move (module docstring)."""
    rows = num_seqs * rows_per_seq
    weights = 0.0
    for name, shape in expected_target_shapes(cfg).items():
        if name.startswith("mtp.") or name == "embed_tokens.weight":
            continue
        size = math.prod(shape) * itemsize
        if name.endswith(EXPERT_SUFFIXES):
            size *= expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, rows) / cfg.num_experts
        weights += size
    weights += rows * cfg.hidden_size * itemsize  # the embedding rows
    kv = len(cfg.full_attention_layers) * num_seqs * context * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4  # fp32
    gdn = len(cfg.linear_attention_layers) * num_seqs * 2 * state
    return StepBytes(weights, kv + gdn)


def mtp_draft_bytes(cfg: TargetConfig, itemsize: int, *, num_seqs: int, k: int) -> float:
    """Weight bytes of k chained MTP drafts (the MTP layer and the LM head each step)."""
    shapes = expected_target_shapes(cfg)
    layer = 0.0
    for name, shape in shapes.items():
        if not name.startswith("mtp."):
            continue
        size = math.prod(shape) * itemsize
        if name.endswith(EXPERT_SUFFIXES):
            size *= expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, num_seqs) / cfg.num_experts
        layer += size
    head = math.prod(shapes["lm_head.weight"]) * itemsize
    return k * (layer + head)


def dflash_draft_bytes(draft: DraftConfig, target: TargetConfig, itemsize: int) -> float:
    """Weight bytes of one DFlash draft forward: its layers, fc and norms, the selector's projection, the LM head."""
    total = 0.0
    for name, shape in expected_draft_shapes(draft).items():
        if name.endswith("codebook"):
            continue  # gathered rows only
        total += math.prod(shape) * itemsize
    return total + target.vocab_size * target.hidden_size * itemsize
