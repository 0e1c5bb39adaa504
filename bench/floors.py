"""Floors: the least time a step can take on this device, from the bytes it must move or the FLOPs it must do.

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

Tensor parallelism (``ft bench --tp N``, the target sharded as ``fast/parallel/plan.py`` cuts it): the ranks run
in lockstep, so a step's floor is one rank's, rank 0's (the scheduler's, and under TP the one that also runs the
DFlash draft or the MTP head, unsharded):

    floor(step) = bytes_per_rank(step) / copy bandwidth  +  collective_bus_bytes(step) / bus bandwidth

- ``bytes_per_rank`` (:func:`target_step_bytes` with ``tp``): every split tensor (column- or row-parallel
  projections, the heads' own vectors, the experts' intermediate slices, the vocabulary-parallel LM head) counts
  ``1/N`` of its bytes, every replicated one (norms, the router, the shared expert's gate) whole; the embedding
  rows ``1/N`` (each rank reads the rows in its vocabulary slice); the K/V context of its ``Hkv/N`` KV heads and
  the GDN state of its ``Hv/N`` value heads. The draft or MTP head is added whole (rank 0 runs it unsharded).
- ``collective_bus_bytes`` (:func:`tp_collective_bytes`): per layer two all-reduces (the mixer's output
  projection, the MLP's or MoE's down projection) and the embedding's one, each of ``rows x C x itemsize``
  bytes, and the LM head's all-gather of ``logit_rows x V x 4`` (fp32 logits), in ring bus bytes: a ring
  all-reduce moves ``2(N-1)/N`` of its tensor through each rank's link, an all-gather ``(N-1)/N`` of its output.
- the bus bandwidth is ``bench/allreduce.py``'s, measured over N spawned ranks before the engines start, at each
  collective's own message size (a decode step's all-reduce of a few KiB is latency bound: its bandwidth there is
  far below the 16 MiB figure); the all-gather is timed as an all-reduce of its output's size (bus bandwidths of
  the two ring collectives are comparable by construction, nccl-tests' busbw). At N = 1 the term is 0.

Not counted under TP: rank 0's broadcast of each step's batch to the other ranks (host objects over gloo).

Quantized weights (``ft bench --load-format dummy --dummy-weight-type T``): a matrix the engine keeps as GGUF
blocks of T (``fast/weights/dummy_quantized.quantizable``) counts its blocks' bytes, ``numel / block_elems *
block_bytes`` (4.5 bits a weight at Q4_K, 3.06 at IQ3_XXS), everything else its dtype's (:func:`stored_bytes`).

A prefill is compute bound: its floor is ``prefill_flops / matmul rate``, the rate measured in the same run
(``bench/measure.matmul_rate``: a large bf16 GEMM), from :func:`prefill_flops` (its docstring gives the count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash2.reference.formats.config import TargetConfig
from dflash2.reference.formats.draft_checkpoint import expected_draft_shapes
from dflash2.reference.formats.draft_config import DraftConfig
from dflash2.reference.formats.weights import expected_target_shapes
from dflash2.fast.kernels.quant.layout import Q, block_shape
from dflash2.fast.parallel.plan import rank_config, shard_spec
from dflash2.fast.weights.dummy_quantized import quantizable

EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def expected_distinct_experts(num_experts: int, top_k: int, rows: int) -> float:
    """E[distinct experts] among ``rows`` independent uniform top-k routings."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def stored_bytes(name: str, shape: tuple[int, ...], itemsize: int, weight_type: str | None = None) -> float:
    """Bytes of canonical tensor ``name`` as the engine holds it: GGUF blocks of ``weight_type`` where the dummy
    quantized load makes it so, else ``itemsize`` a value."""
    if weight_type is not None and quantizable(name, shape, Q[weight_type]):
        elems, nbytes = block_shape(Q[weight_type])
        return math.prod(shape) / elems * nbytes
    return math.prod(shape) * itemsize


@dataclass(frozen=True)
class StepBytes:
    weights: float
    caches: float

    @property
    def total(self) -> float:
        return self.weights + self.caches


def target_step_bytes(cfg: TargetConfig, itemsize: int, *, num_seqs: int, rows_per_seq: int,
                      context: int, weight_type: str | None = None, tp: int = 1) -> StepBytes:
    """Bytes one target step over ``num_seqs`` sequences of ``rows_per_seq`` rows must move on one of ``tp``
    ranks (module docstring; ``tp`` 1: the whole target). A tensor ``fast/parallel/plan.py`` splits counts
    ``1/tp`` of its bytes (its every segment is cut into tp equal chunks), a replicated one whole; the
    embedding rows ``1/tp``; the caches those of the rank's ``Hkv/tp`` KV heads and ``Hv/tp`` GDN value heads.
    Refuses (``ConfigError`` naming the field and value) a head count or size ``tp`` does not divide."""
    local = rank_config(cfg, tp)  # the rank's head counts (cfg itself at tp=1); refuses what tp does not divide
    rows = num_seqs * rows_per_seq
    weights = 0.0
    for name, shape in expected_target_shapes(cfg).items():
        if name.startswith("mtp.") or name == "embed_tokens.weight":
            continue
        size = stored_bytes(name, shape, itemsize, weight_type)
        if name.endswith(EXPERT_SUFFIXES):  # every rank holds every expert, its I/tp slice: the same routing factor
            size *= expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, rows) / cfg.num_experts
        if not shard_spec(name, cfg).replicated:
            size /= tp
        weights += size
    weights += rows * cfg.hidden_size * itemsize / tp  # the embedding rows, each read by the rank whose slice holds it
    kv = len(cfg.full_attention_layers) * num_seqs * context * 2 * local.num_key_value_heads * cfg.head_dim * itemsize
    state = local.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4  # fp32
    gdn = len(cfg.linear_attention_layers) * num_seqs * 2 * state
    return StepBytes(weights, kv + gdn)


@dataclass(frozen=True)
class CollectiveBytes:
    """One tensor-parallel step's collectives, per rank (:func:`tp_collective_bytes`): the ring bus bytes of its
    all-reduces and of its all-gather, and the size of each one's tensor (its message, for the bandwidth there)."""

    all_reduce: float  # bus bytes of the 2 L + 1 all-reduces
    all_gather: float  # bus bytes of the LM head's all-gather
    all_reduce_message: int  # bytes of one all-reduce's tensor, rows x C x itemsize
    all_gather_message: int  # bytes of the gathered logits, logit_rows x V x 4

    @property
    def total(self) -> float:
        return self.all_reduce + self.all_gather

    def seconds(self, bus_bandwidth) -> float:
        """The floor's collective term: each collective's bus bytes over ``bus_bandwidth(message bytes)`` (bytes/s,
        measured at that message size); 0 with nothing to move (tp=1), without asking for a bandwidth."""
        if self.total == 0:
            return 0.0
        return (self.all_reduce / bus_bandwidth(self.all_reduce_message)
                + self.all_gather / bus_bandwidth(self.all_gather_message))


def tp_collective_bytes(cfg: TargetConfig, itemsize: int, *, rows: int, logit_rows: int, tp: int) -> CollectiveBytes:
    """The bytes one rank's link carries in one target step over ``rows`` rows on ``tp`` ranks (ring algorithms)::

        all-reduces  (2 L + 1) x rows x C x itemsize x 2 (tp - 1) / tp
                     two a layer (the attention or GDN output projection, the MLP or MoE down projection, both
                     row-parallel: the partial sums), one for the vocabulary-parallel embedding
        all-gather   logit_rows x V x 4 x (tp - 1) / tp
                     the LM head's vocabulary slices of the fp32 logits, gathered on every rank

    ``L`` = ``num_hidden_layers`` (the MTP head and a DFlash draft run unsharded on rank 0: no collective).
    tp=1: zero. A decode step has ``rows = logit_rows = num_seqs``; a verify step ``num_seqs x (k + 1)`` both.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: expected an integer >= 1")
    reduce_message = rows * cfg.hidden_size * itemsize
    gather_message = logit_rows * cfg.vocab_size * 4
    count = 2 * cfg.num_hidden_layers + 1
    return CollectiveBytes(all_reduce=count * reduce_message * 2 * (tp - 1) / tp,
                           all_gather=gather_message * (tp - 1) / tp,
                           all_reduce_message=reduce_message, all_gather_message=gather_message)


def mtp_draft_bytes(cfg: TargetConfig, itemsize: int, *, num_seqs: int, k: int, weight_type: str | None = None) -> float:
    """Weight bytes of k chained MTP drafts (the MTP layer and the LM head each step)."""
    shapes = expected_target_shapes(cfg)
    layer = 0.0
    for name, shape in shapes.items():
        if not name.startswith("mtp."):
            continue
        size = stored_bytes(name, shape, itemsize, weight_type)
        if name.endswith(EXPERT_SUFFIXES):
            size *= expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, num_seqs) / cfg.num_experts
        layer += size
    head = stored_bytes("lm_head.weight", shapes["lm_head.weight"], itemsize, weight_type)
    return k * (layer + head)


def dflash_draft_bytes(draft: DraftConfig, target: TargetConfig, itemsize: int, weight_type: str | None = None) -> float:
    """Weight bytes of one DFlash draft forward: its layers, fc and norms, the selector's projection, the LM head."""
    total = 0.0
    for name, shape in expected_draft_shapes(draft).items():
        if name.endswith("codebook"):
            continue  # gathered rows only
        total += math.prod(shape) * itemsize
    head = (target.vocab_size, target.hidden_size)  # the target's head (its blocks, for a quantized target)
    return total + stored_bytes("lm_head.weight", head, itemsize, weight_type)


GDN_CHUNK = 64  # rows per chunk of the chunked gated delta rule (flash-linear-attention's BT, fast/kernels/gdn/gdn_prefill.py)


def target_token_matmul_params(cfg: TargetConfig) -> float:
    """Weights one prompt row multiplies in the target's layers (each one multiply-add): every matrix of the
    ``L`` layers; the GDN's depthwise conv (K taps a channel); an MoE layer's router, its top-k routed experts
    (``k/E`` of the expert tensors) and its shared expert with its gate. Not counted: the embedding (a row
    gather), the LM head (:func:`prefill_flops` counts it for the rows whose logits are computed), the MTP head,
    the vectors (norm weights, ``dt_bias``, ``A_log``: elementwise work)."""
    total = 0.0
    for name, shape in expected_target_shapes(cfg).items():
        if name.startswith("mtp.") or name in ("embed_tokens.weight", "lm_head.weight") or len(shape) == 1:
            continue
        size = math.prod(shape)
        if name.endswith(EXPERT_SUFFIXES):
            size *= cfg.num_experts_per_tok / cfg.num_experts
        total += size
    return total


def gdn_token_flops(cfg: TargetConfig) -> float:
    """FLOPs of one row of the chunked gated delta rule in one GDN layer (chunk ``c = GDN_CHUNK``, per value
    head ``Hv``; ``Dk``, ``Dv`` the head dims), the products of flash-linear-attention's chunked form, each
    chunk's ``[c, c]`` blocks in full as its kernels compute them:

    - ``A = beta K K^T`` (2 c Dk), ``(I + A)^-1`` by substitution (2 c^2 / 3: c^3 / 3 multiply-adds a chunk),
      ``W = A^-1 (beta exp(g) K)`` and ``U = A^-1 (beta V)`` (2 c (Dk + Dv));
    - the state ``S [Dk, Dv]``: ``V' = U - W S``, ``S += K^T V'``, ``O = Q S`` (3 x 2 Dk Dv);
    - within the chunk: ``Q K^T`` (2 c Dk) and its masked product with ``V'`` (2 c Dv).

    Per row and value head: ``6 Dk Dv + c (6 Dk + 4 Dv) + 2 c^2 / 3``. A prompt's last partial chunk is counted
    by its rows. It is small beside the projections (0.8% of a 4,096-token prefill's FLOPs on the 27B shape, 3.3%
    on the 35B-A3B's), so these approximations move the floor little.
    """
    c, dk, dv = GDN_CHUNK, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return cfg.linear_num_value_heads * (6 * dk * dv + c * (6 * dk + 4 * dv) + 2 * c * c / 3)


def prefill_flops(cfg: TargetConfig, num_tokens: int, *, start: int = 0, logits_rows: int = 1) -> float:
    """FLOPs of the target's forward over prompt rows ``start .. start + num_tokens - 1`` of one prompt (a whole
    prompt of n tokens: ``start = 0``, ``num_tokens = n``; a chunk of a longer one: its start), computing
    ``logits_rows`` rows of logits (1, the prompt's last, when the rows end the prompt; 0 for an earlier chunk).
    A multiply-add is 2 FLOPs:

        2 P num_tokens                                   the weights (P: :func:`target_token_matmul_params`)
      + 2 V C logits_rows                                the LM head
      + L_full 4 H D (num_tokens start + num_tokens (num_tokens + 1) / 2)
                                                         causal attention: the row at prompt position i
                                                         (0-based) scores i + 1 keys, Q K^T and P V 2 H D
                                                         FLOPs a key each
      + L_gdn num_tokens gdn_token_flops                 the GDN recurrence (:func:`gdn_token_flops`)

    A prompt's chunks sum to the whole prompt's FLOPs. Not counted: elementwise work (norms, RoPE, gates, softmax),
    and whatever a speculative proposer does during the prefill (the DFlash draft's or the MTP head's pass over the
    prompt): the floor is the target's alone.
    """
    n = num_tokens
    attention = 4 * cfg.num_attention_heads * cfg.head_dim * (n * start + n * (n + 1) / 2)
    return (2 * target_token_matmul_params(cfg) * n + 2 * cfg.vocab_size * cfg.hidden_size * logits_rows
            + len(cfg.full_attention_layers) * attention + len(cfg.linear_attention_layers) * n * gdn_token_flops(cfg))
