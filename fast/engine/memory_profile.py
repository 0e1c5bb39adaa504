"""Peak activation memory of the target's forwards, measured by running them once before the caches are sized.

vLLM's memory plan, for our steps: after the weights are loaded, a forward over the largest prefill chunk
(``max_num_batched_tokens`` rows of one sequence from position 0: every layer's temporaries at their largest,
the chunked GDN kernels' and the MoE's included) is run on throw-away pools of one slot, and the allocator's
peak over what was allocated before it is that forward's activation bytes. The caches then get what is left
within ``memory_ratio`` after the weights, that peak and an allowance for the CUDA graphs' memory pools
(``fast/engine/memory.py``).

The graphs' pools (one per kind of captured step: the target's decode step, the speculative step) keep the
temporaries of the largest step captured in them for as long as the engine lives. That step has at most
``max_running_req * (k + 1)`` rows; the allowance is the activation peak of a forward of that many rows,
times the number of pools. The forward measured is a prefill of those rows (the same matmuls; a verify's
attention and GDN temporaries per row are of the same order), so the allowance is an estimate: the warm-up,
which captures every graph, logs the memory it really reached (``log_reached``).

The draft's temporaries beyond a step's activations have their own workspace (``dflash_workspace_bytes``).
"""

from __future__ import annotations

import logging

import torch

from ..model.batch import ForwardBatch
from ..model.pools import CachePools
from ..model.target import FastTarget
from .scheduler import pages_for

logger = logging.getLogger("dflash2.fast.engine")
MiB = float(1 << 20)


def forward_peak_bytes(target: FastTarget, rows: int, *, page_size: int, max_verify_rows: int,
                       mtp: bool = False) -> int:
    """Bytes the allocator reached above its level before a prefill forward of ``rows`` rows (CUDA only).

    The pools of the forward (one slot, the pages of ``rows`` tokens) are allocated before the level is read,
    so they are not counted; they are freed afterwards."""
    device = target.device
    pools = CachePools(target.cfg, pages_for(rows, page_size), page_size, 1, max_verify_rows, target.dtype, device,
                       mtp=mtp)
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
                     page_size: int, max_verify_rows: int, mtp: bool = False) -> tuple[int, int]:
    """(the largest prefill chunk's activation peak, the CUDA graphs' allowance) in bytes (module docstring)."""
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
