"""Sizing the caches at startup: KV pages and state slots out of one byte budget.

The budget: on CUDA, after the weights are loaded, ``memory_ratio * total`` less everything in use (the weights,
the CUDA context, the libraries' workspaces), less the peak activations of the largest prefill chunk and an
allowance for the CUDA graphs' pools, both measured by a profiling forward (``forward_peak_bytes`` below, as
vLLM's memory plan); on CPU, ``cpu_cache_bytes``. Out of it, first one state slot per running request (the
target's GDN state plus, with DFlash, the draft's per-request K/V ring and its ``dflash_window`` of context
rows), then the prefix cache's snapshot slots (each the GDN state and the proposer's saved state:
``num_snapshots``, chosen by ``snapshot_count``), then as many KV pages as fit, capped at what
``max_running_req`` requests of ``max_model_len`` tokens can ever hold. Before either (on CUDA), a workspace is
set aside for the largest temporaries the draft needs beyond a step's activations (``dflash_workspace_bytes``):
the tapped features, context rows and context K/V of a full prefill chunk, or one group of ring rebuilds (a
prefix-cache restore rebuilds ``rebuild_group`` rings per call, so the workspace does not grow with
``max_running_req``), whichever is larger. The sizes come from the pools' own ``bytes_per_token`` and
``bytes_per_slot`` so this module knows nothing of their layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dflash2.reference.formats.draft_config import DraftConfig
from dflash2.reference.formats.errors import ConfigError

from ..model.batch import ForwardBatch
from ..model.pools import CachePools
from ..model.target import FastTarget
from ..speculative.ring import RingPool, WindowPool
from .config import EngineConfig
from .scheduler import pages_for

logger = logging.getLogger("dflash2.fast.engine")
MiB = float(1 << 20)


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    page_size: int
    num_pages: int
    num_slots: int
    kv_bytes_per_token: int  # target full-attention layers (and the MTP layer) for one position
    state_bytes_per_slot: int  # the target's GDN state of one request
    draft_bytes_per_slot: int  # the draft's ring and dflash_window of one request (0 without DFlash)
    workspace_bytes: int = 0  # set aside for the draft's prefill features or a group of ring rebuilds
    num_snapshots: int = 0  # prefix-cache snapshot slots
    snapshot_bytes: int = 0  # one snapshot slot: the GDN state and the proposer's saved state
    activation_bytes: int = 0  # CUDA: the largest prefill chunk's measured peak, kept out of the budget
    graph_pool_bytes: int = 0  # CUDA: the graphs' pools allowance, kept out of the budget
    budget_pages: int = 0  # the pages the budget holds before the cap of max_running_req x max_model_len tokens

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return (self.kv_tokens * self.kv_bytes_per_token
                + self.num_slots * (self.state_bytes_per_slot + self.draft_bytes_per_slot) + self.workspace_bytes
                + self.num_snapshots * self.snapshot_bytes)


def dflash_slot_bytes(cfg: DraftConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(K/V ring, dflash_window) bytes of one request, as ``fast/speculative/ring.py`` allocates them."""
    ring = RingPool.bytes_per_slot(cfg.sliding_window, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                   cfg.head_dim, dtype)
    return ring, WindowPool.bytes_per_slot(cfg.sliding_window, cfg.hidden_size, dtype)


def rebuild_group(cfg: DraftConfig, max_num_batched_tokens: int) -> int:
    """Rings rebuilt per call on a prefix-cache restore: as many as a prefill chunk's rows cover (at least one)."""
    return max(1, max_num_batched_tokens // max(1, cfg.sliding_window - 1))


def dflash_workspace_bytes(cfg: DraftConfig, dtype: torch.dtype, *, max_num_batched_tokens: int,
                           num_slots: int) -> int:
    """The draft's largest temporary outside a step's activations, in bytes.

    A prefill chunk of N rows: the tapped target features [N, m*C], the context rows [N, C] and
    their K/V for every draft layer [L, N, Hkv, D] x 2. A ring rebuild of R slots (prefix-cache
    restore, ``FastDFlashProposer.restore``): the R * (W-1) window rows [., C] and their K/V, with R
    at most ``rebuild_group`` (and ``num_slots``).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    prefill = max_num_batched_tokens * (cfg.num_taps * cfg.hidden_size + cfg.hidden_size + kv_row)
    group = min(num_slots, rebuild_group(cfg, max_num_batched_tokens))
    rebuild = group * (cfg.sliding_window - 1) * (cfg.hidden_size + kv_row)
    return max(prefill, rebuild) * itemsize


SNAPSHOT_SHARE = 0.15  # the most of the free cache budget automatic snapshot slots take (the rest: KV pages)
SNAPSHOTS_PER_SLOT = 4  # automatic snapshot slots per running request, at most


def snapshot_count(requested: int | None, *, free_bytes: int, snapshot_bytes: int, num_slots: int) -> int:
    """Prefix-cache snapshot slots: ``requested``, or (None) up to ``SNAPSHOTS_PER_SLOT`` per running request
    within ``SNAPSHOT_SHARE`` of ``free_bytes`` (the budget left after the running requests' slots and the
    workspace: the rest is for KV pages); 0 when not even one fits there."""
    if requested is not None:
        return requested
    fits = int(max(0, free_bytes) * SNAPSHOT_SHARE) // max(1, snapshot_bytes)
    return min(SNAPSHOTS_PER_SLOT * num_slots, fits)


def cache_budget_bytes(cfg: EngineConfig, device: torch.device) -> int:
    """Bytes within ``memory_ratio`` not in use (call after the weights are on the device; the caller takes the
    activations out).

    On CUDA: ``free + (reserved - allocated) - total * (1 - memory_ratio)``. Memory the caching allocator
    holds but no tensor uses (what a load's freed temporaries leave behind) is free for the caches: the
    driver's ``free`` alone counts it as used (logged at startup).
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        logger.info("cache budget: %.1f MiB free on the device, %.1f MiB cached by the allocator unused, %.1f MiB "
                    "kept out (1 - memory_ratio)", free / MiB, cached / MiB, total * (1.0 - cfg.memory_ratio) / MiB)
        return int(free + cached - total * (1.0 - cfg.memory_ratio))
    return cfg.cpu_cache_bytes


def plan_memory(budget_bytes: int, *, page_size: int, num_slots: int, max_model_len: int, kv_bytes_per_token: int,
                state_bytes_per_slot: int, draft_bytes_per_slot: int = 0, workspace_bytes: int = 0,
                budget_field: str = "memory_ratio", num_snapshots: int = 0, snapshot_bytes: int = 0,
                activation_bytes: int = 0, graph_pool_bytes: int = 0,
                device_total_bytes: int | None = None) -> MemoryPlan:
    """Workspace, slots, snapshot slots, then pages; refuse a budget that cannot hold the slots and one page,
    saying by how much it falls short (and, given ``device_total_bytes``, as a fraction of the device)."""
    slot_bytes = num_slots * (state_bytes_per_slot + draft_bytes_per_slot) + workspace_bytes
    slot_bytes += num_snapshots * snapshot_bytes
    page_bytes = page_size * kv_bytes_per_token
    budget_pages = max(0, budget_bytes - slot_bytes) // page_bytes if page_bytes else 0
    num_pages = min(budget_pages, num_slots * pages_for(max_model_len, page_size))
    if num_pages < 1:
        short = slot_bytes + page_bytes - budget_bytes
        by = f" (+{short / device_total_bytes:.3f} of the device's memory)" if device_total_bytes else ""
        kept = (f" (after {activation_bytes / MiB:.1f} MiB of prefill activations and {graph_pool_bytes / MiB:.1f} "
                f"MiB for CUDA graphs)" if activation_bytes or graph_pool_bytes else "")
        raise ConfigError(
            f"{budget_field}: the cache budget of {budget_bytes / MiB:.1f} MiB{kept} holds {num_slots} state slots and "
            f"{num_snapshots} prefix-cache snapshot slots ({slot_bytes / MiB:.1f} MiB with a "
            f"{workspace_bytes / MiB:.1f} MiB draft workspace) and no KV page ({page_bytes} bytes each), "
            f"{short / MiB:.1f} MiB short of one: expected {budget_field} raised by at least that{by}, a smaller "
            "max_running_req or fewer prefix_snapshots")
    return MemoryPlan(budget_bytes, page_size, num_pages, num_slots, kv_bytes_per_token, state_bytes_per_slot,
                      draft_bytes_per_slot, workspace_bytes, num_snapshots, snapshot_bytes, activation_bytes,
                      graph_pool_bytes, budget_pages)


def log_plan(plan: MemoryPlan, *, draft_ring_bytes: int = 0, draft_window_bytes: int = 0) -> None:
    logger.info("KV cache: %d tokens (%d pages of %d), %.1f MiB; %d state slots of %.2f MiB%s",
                plan.kv_tokens, plan.num_pages, plan.page_size, plan.kv_tokens * plan.kv_bytes_per_token / MiB,
                plan.num_slots, plan.state_bytes_per_slot / MiB,
                f" (the budget holds {plan.budget_pages * plan.page_size} tokens; max_running_req x max_model_len "
                "caps them)" if plan.budget_pages > plan.num_pages else "")
    if plan.draft_bytes_per_slot:
        logger.info("DFlash draft per slot: %.2f MiB (K/V ring %.2f MiB + dflash_window %.2f MiB), %d slots: %.1f MiB",
                    plan.draft_bytes_per_slot / MiB, draft_ring_bytes / MiB, draft_window_bytes / MiB,
                    plan.num_slots, plan.num_slots * plan.draft_bytes_per_slot / MiB)
    if plan.workspace_bytes:
        logger.info("DFlash draft workspace (prefill features or a group of ring rebuilds): %.1f MiB",
                    plan.workspace_bytes / MiB)
    if plan.num_snapshots:
        logger.info("prefix cache: %d snapshot slots of %.2f MiB (GDN state and the proposer's saved state; with "
                    "overlap scheduling one per request slot checkpoints it), %.1f MiB",
                    plan.num_snapshots, plan.snapshot_bytes / MiB, plan.num_snapshots * plan.snapshot_bytes / MiB)


# -- measured activations -----------------------------------------------------------------------------
# Peak activation memory of the target's forwards, measured by running them once before the caches are sized.
#
# vLLM's memory plan, for our steps: after the weights are loaded, a forward over the largest prefill chunk
# (``max_num_batched_tokens`` rows of one sequence from position 0: every layer's temporaries at their largest,
# the chunked GDN kernels' and the MoE's included) is run on throw-away pools of one slot, and the allocator's
# peak over what was allocated before it is that forward's activation bytes. The caches then get what is left
# within ``memory_ratio`` after the weights, that peak and an allowance for the CUDA graphs' memory pools.
#
# The graphs' pools (one per kind of captured step: the target's decode step, the speculative step) keep the
# temporaries of the largest step captured in them for as long as the engine lives. That step has at most
# ``max_running_req * (k + 1)`` rows; the allowance is the activation peak of a forward of that many rows,
# times the number of pools. The forward measured is a prefill of those rows (the same matmuls; a verify's
# attention and GDN temporaries per row are of the same order), so the allowance is an estimate: the warm-up,
# which captures every graph, logs the memory it really reached (``log_reached``). The captured prefill steps
# (``graphs/prefill_graphs.py``, where ``prefill_graph_rows`` is set) have a pool of their own: a forward at their
# largest key's rows, every capture's kept outputs and the draft's observe workspace (``startup.py``).
#
# The draft's temporaries beyond a step's activations have their own workspace (``dflash_workspace_bytes``).


def forward_peak_bytes(target: FastTarget, rows: int, *, page_size: int, max_verify_rows: int,
                       mtp: bool = False) -> int:
    """Bytes the allocator reached above its level before a prefill forward of ``rows`` rows (CUDA only).

    The pools of the forward (one slot, the pages of ``rows`` tokens) are allocated before the level is read,
    so they are not counted; they are freed afterwards."""
    device = target.device
    # the rank's heads (local_cfg: target.cfg at tp=1); an MTP layer, unsharded, has the model's
    pools = CachePools(target.local_cfg, pages_for(rows, page_size), page_size, 1, max_verify_rows, target.dtype,
                       device, mtp=mtp, mtp_cfg=target.cfg)
    tokens = torch.arange(rows, device=device) % target.cfg.vocab_size
    batch = ForwardBatch(
        token_ids=tokens, positions=torch.arange(rows, device=device),
        cu_seqlens=torch.tensor([0, rows], dtype=torch.int32, device=device),
        state_slots=torch.zeros(1, dtype=torch.long, device=device),
        kv_slot_mapping=torch.arange(rows, device=device),
        block_tables=torch.arange(pages_for(rows, page_size), dtype=torch.int32, device=device)[None],
        context_lens=torch.tensor([rows], device=device), is_verify=False,
        logits_rows=torch.tensor([rows - 1], device=device), max_query_len=rows)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    level = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        out = target.forward(batch, pools)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - level
    del out, batch, pools
    torch.cuda.empty_cache()
    return peak


def activation_bytes(target: FastTarget, *, max_num_batched_tokens: int, max_step_rows: int, graph_pools: int,
                     page_size: int, max_verify_rows: int, mtp: bool = False,
                     prefill_graph_rows: int = 0) -> tuple[int, int]:
    """(the largest prefill chunk's activation peak, the CUDA graphs' allowance) in bytes (module docstring).
    ``prefill_graph_rows``: the rows of the largest captured prefill step (``prefill_graphs.py``, its own pool),
    0 for none."""
    prefill = forward_peak_bytes(target, max_num_batched_tokens, page_size=page_size,
                                 max_verify_rows=max_verify_rows, mtp=mtp)
    graphs = 0
    if graph_pools:
        step = forward_peak_bytes(target, max_step_rows, page_size=page_size, max_verify_rows=max_verify_rows,
                                  mtp=mtp)
        graphs = graph_pools * step
    logger.info("activations: %.1f MiB at a %d-row prefill chunk; CUDA graph pools allowed %.1f MiB (%d x a "
                "%d-row step's %.1f MiB)", prefill / MiB, max_num_batched_tokens, graphs / MiB, graph_pools,
                max_step_rows, graphs / max(1, graph_pools) / MiB)
    if prefill_graph_rows:
        # the same forward as the chunk's above at the graph's rows: one sequence, as the key of one whole chunk has
        # (the padded keys' many short sequences take the GDN recurrence in place, with fewer temporaries than the
        # chunked form's); an estimate, like the decode pools': the warm-up logs what was reached
        captured = forward_peak_bytes(target, prefill_graph_rows, page_size=page_size,
                                      max_verify_rows=max_verify_rows, mtp=mtp)
        logger.info("CUDA graph pool of the prefill steps allowed %.1f MiB (a %d-row prefill's activations)",
                    captured / MiB, prefill_graph_rows)
        graphs += captured
    return prefill, graphs


def log_reached(device: torch.device, memory_ratio: float) -> None:
    """After the warm-up (every graph captured, every path run): the device memory in use beside what
    ``memory_ratio`` allows, so a plan that under-estimated shows at startup, not at the first long prompt."""
    free, total = torch.cuda.mem_get_info(device)
    used, allowed = total - free, memory_ratio * total
    level = logging.WARNING if used > allowed else logging.INFO
    logger.log(level, "device memory after the warm-up: %.2f GiB in use of the %.2f GiB memory_ratio %.2f allows "
               "(torch peak %.2f GiB)", used / 2**30, allowed / 2**30, memory_ratio,
               torch.cuda.max_memory_reserved(device) / 2**30)
