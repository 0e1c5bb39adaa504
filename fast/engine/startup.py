"""Startup: an EngineConfig to a loaded target, its caches, its proposer and its tokenizer.

Every refusal happens here, before any request, with the reference's errors, because both sides
use the same loaders and validators (``reference/formats/config.py``, ``checkpoint.py``,
``draft_config.py``, ``draft_checkpoint.py``, ``tokenizer.py``), in the reference runner's order:
the speculative flags (``EngineConfig``), the target checkpoint, the MTP head or the draft, the
tokenizer. Then the caches are sized (``memory.py``) and allocated once.

Tensor-parallel ranks (``EngineConfig.tensor_parallel_size`` > 1): :func:`load_model` builds one rank's shard and
its pools (``tp``); ``engine/tp/workers.py`` starts the other ranks and says what is sent to them, and when. The
proposer runs on rank 0 only and unsharded (vLLM and SGLang shard theirs with the target): a draft step then costs
its one-GPU time with no collective in it, and the workers need no proposer messages; the price is rank 0's memory
for a full-vocabulary copy of the embedding and LM head beside its slices (which the draft and the MTP head read)
and, with MTP, a full MTP layer and its K/V at every head. Under tp > 1 for now: the target's forwards are captured
(``TargetGraphs``, mirrored on the workers) but a speculative step is not captured whole (its proposer is rank 0's),
and no GGUF-quantized target (:func:`check_tp_target`, ``EngineConfig``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dflash2.reference.formats.checkpoint import load_target, target_config
from dflash2.reference.formats.gguf_file import is_gguf_path
from dflash2.reference.formats.config import TargetConfig, resolve_mtp_k
from dflash2.reference.formats.draft_checkpoint import draft_config, load_draft
from dflash2.reference.formats.errors import ConfigError, expect
from dflash2.reference.formats.tokenizer import check_tokenizer_fits, eos_token_ids, has_tokenizer, load_tokenizer
from dflash2.reference.tiny.dummy import DUMMY_LOAD_FORMAT, dummy_draft_weights, dummy_target_weights

from ..kernels.common.pdl import LaunchSettings, configure
from ..model.draft import FastDraft
from ..weights.dummy_quantized import DummyQuantizedWeights
from ..weights.gguf_quantized import load_gguf_target_quantized
from ..model.mtp import FastMTP
from ..model.params import Params
from ..model.pools import CachePools, gdn_bytes_per_slot, kv_bytes_per_token, verify_bytes_per_seq
from ..model.target import FastTarget
from ..parallel.group import TPGroup
from ..parallel.plan import rank_config
from ..speculative.dflash import FastDFlashProposer
from ..speculative.mtp import FastMTPProposer
from .config import EngineConfig
from .memory import (MemoryPlan, activation_bytes, cache_budget_bytes, dflash_slot_bytes, dflash_workspace_bytes,
                     log_plan, plan_memory, rebuild_group, snapshot_count)
from .graphs.prefill_graphs import graph_rows, outputs_bytes
from .snapshots import StateSnapshots
from ..speculative.proposer import Proposer

logger = logging.getLogger("dflash2.fast.engine")


@dataclass
class LoadedModel:
    config: EngineConfig  # resolved: device and dtype concrete
    target_cfg: TargetConfig
    target: FastTarget
    pools: CachePools
    proposer: Proposer | None
    k: int  # k per verify; 0 without speculative decoding
    max_model_len: int
    memory: MemoryPlan
    tokenizer: object | None
    stop_token_ids: tuple[int, ...]
    snapshots: StateSnapshots | None = None  # the prefix cache's snapshot slots (None: prefix caching off)
    num_checkpoints: int = 0  # of those, the last ones: a checkpoint per request slot (engine/checkpoints.py)
    load_bytes: tuple[int, int] | None = None  # CUDA: (the weights' bytes, the load's peak bytes) on the device


def load_model(config: EngineConfig, tp: TPGroup | None = None) -> LoadedModel:
    """``tp`` (tensor_parallel_size > 1): this rank's group; the target is this rank's shard (on cuda:rank under
    CUDA), the caches are sized per rank from its ``local_cfg`` and the page count is the minimum over the ranks."""
    tp = tp or TPGroup.single()
    cfg = config.resolved()
    torch.manual_seed(cfg.seed)
    configure(LaunchSettings(pdl=cfg.pdl, l2_prefetch=cfg.l2_prefetch))  # before any kernel is launched
    device, dtype = torch.device(cfg.device), cfg.torch_dtype
    if tp.parallel and device.type == "cuda":
        device = torch.device("cuda", tp.rank)
        cfg = replace(cfg, device=str(device))
    if device.type == "cuda":  # the load's peak over what stays (the weights): reported below
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    dummy = cfg.load_format == DUMMY_LOAD_FORMAT
    if dummy:  # the config is validated as for a real checkpoint; the tensors are drawn on the device
        target_cfg = target_config(cfg.model_path)  # a folder's config.json or a GGUF file's metadata
        weights = dummy_target_weights(target_cfg, seed=cfg.seed, dtype=dtype, device=device)
        if cfg.dummy_weight_type is not None:  # the matrices as random GGUF blocks, kept quantized
            weights = DummyQuantizedWeights(weights, weights.shapes, cfg.dummy_weight_type, cfg.seed, device,
                                            tied=target_cfg.tie_word_embeddings)
    elif is_gguf_path(cfg.model_path):  # quantized matrices stay quantized (fast/weights/gguf_quantized.py)
        target_cfg, weights = load_gguf_target_quantized(cfg.model_path)
    else:
        target_cfg, weights = load_target(cfg.model_path, dtype=None)  # as stored: the model casts per tensor
    max_model_len = cfg.max_model_len or target_cfg.max_position_embeddings
    expect(max_model_len <= target_cfg.max_position_embeddings, ConfigError, "max_model_len", max_model_len,
           f"at most the model's context of {target_cfg.max_position_embeddings} tokens")
    k, draft_cfg, draft_weights = 0, None, None
    if cfg.speculative_algorithm == "mtp":
        k = resolve_mtp_k(target_cfg, cfg.speculative_num_steps)
    elif cfg.speculative_algorithm == "dflash":
        if dummy or tp.rank > 0:  # a worker needs the draft's config (k, validated) and not its weights
            draft_cfg = draft_config(cfg.speculative_draft_model_path, target_cfg, cfg.speculative_num_steps)
            if tp.rank == 0:
                draft_weights = dummy_draft_weights(draft_cfg, seed=cfg.seed + 1, dtype=dtype, device=device)
        else:
            draft_cfg, draft_weights = load_draft(cfg.speculative_draft_model_path, target_cfg,
                                                  cfg.speculative_num_steps)
        k = draft_cfg.k
    tokenizer = None
    if has_tokenizer(cfg.model_path):
        tokenizer = load_tokenizer(cfg.model_path)
        check_tokenizer_fits(tokenizer, target_cfg.vocab_size)
    stop_token_ids = eos_token_ids(cfg.model_path, tokenizer)

    proposes = tp.rank == 0  # the proposer is rank 0's alone (module docstring)
    tap_layers = draft_cfg.target_layer_ids if draft_cfg is not None and proposes else ()
    target = FastTarget(target_cfg, weights, dtype, device, tap_layers, tp=tp)
    local_cfg = target.local_cfg  # this rank's heads and widths (target_cfg itself at tp=1)
    draft = mtp = None
    if draft_cfg is not None and proposes:
        embed, lm_head = target.embed, target.lm_head
        if tp.parallel:  # the target holds vocabulary slices; the unsharded draft reads every row
            full = Params(target_cfg, weights, dtype, device)
            embed, lm_head = full.get("embed_tokens.weight"), full.weight("lm_head.weight")
        draft = FastDraft(draft_cfg, draft_weights, embed, lm_head, dtype, device)
    if cfg.speculative_algorithm == "mtp" and proposes:  # unsharded under tp: its own full embedding and head
        mtp = FastMTP(target_cfg, weights, dtype, device, target=None if tp.parallel else target)
    del weights, draft_weights
    load = None
    if device.type == "cuda":
        load = (torch.cuda.memory_allocated(device) - before, torch.cuda.max_memory_allocated(device) - before)
        logger.info("weights: %.2f GiB on the device; the load's peak was %.2f GiB over them", load[0] / 2**30,
                    (load[1] - load[0]) / 2**30)

    num_slots = cfg.max_running_req
    # the proposer's per-slot state (DFlash ring and window) and temporaries: rank 0's alone
    ring_bytes, window_bytes = dflash_slot_bytes(draft_cfg, dtype) if draft is not None else (0, 0)
    use_mtp = cfg.speculative_algorithm == "mtp"
    mtp_kv = use_mtp and proposes  # the MTP layer's K/V: rank 0's, at every head (the layer is unsharded)
    activations = graph_pools_bytes = 0
    if device.type == "cuda":  # the largest prefill chunk's temporaries and the graphs' pools stay out of the caches
        # whole speculative steps have a pool of their own, except under tp (they are not captured there)
        whole_steps = cfg.speculative and not tp.parallel
        graph_pools = 0 if cfg.enforce_eager or not target.capturable() else (2 if whole_steps else 1)
        prefill_rows = 0  # the largest captured prefill step's rows (engine.py makes those graphs)
        if graph_pools and not tp.parallel:
            prefill_rows = graph_rows(min(cfg.prefill_graph_rows, cfg.max_num_batched_tokens), num_slots)
        activations, graph_pools_bytes = activation_bytes(
            target, max_num_batched_tokens=cfg.max_num_batched_tokens, max_step_rows=num_slots * (k + 1),
            graph_pools=graph_pools, page_size=cfg.page_size, max_verify_rows=k + 1, mtp=mtp_kv,
            prefill_graph_rows=prefill_rows)
        if prefill_rows:  # each capture's outputs stay in that pool; the draft's observe of the rows runs there too
            graph_pools_bytes += outputs_bytes(min(cfg.prefill_graph_rows, cfg.max_num_batched_tokens), num_slots,
                                               hidden_size=target_cfg.hidden_size, num_taps=len(tap_layers),
                                               vocab_size=target_cfg.vocab_size, itemsize=_itemsize(dtype))
            if draft is not None:
                graph_pools_bytes += dflash_workspace_bytes(draft_cfg, dtype, max_num_batched_tokens=prefill_rows,
                                                            num_slots=1)
    budget = cache_budget_bytes(cfg, device) - activations - graph_pools_bytes
    state_bytes = gdn_bytes_per_slot(local_cfg, dtype) + verify_bytes_per_seq(local_cfg, dtype, k + 1)
    # on CUDA the budget is everything within memory_ratio, so the draft's temporaries come out of it;
    # on CPU cpu_cache_bytes budgets the caches alone
    workspace = 0 if draft is None or device.type != "cuda" else dflash_workspace_bytes(
        draft_cfg, dtype, max_num_batched_tokens=cfg.max_num_batched_tokens, num_slots=num_slots)
    num_snapshots = snapshot_bytes = num_checkpoints = 0
    if cfg.prefix_caching:  # a snapshot slot: the GDN state and what the proposer saves (window or pending row)
        saved = window_bytes if draft is not None else target_cfg.hidden_size * _itemsize(dtype) if mtp_kv else 0
        snapshot_bytes = gdn_bytes_per_slot(local_cfg, dtype) + saved
        free = budget - num_slots * (state_bytes + ring_bytes + window_bytes) - workspace
        num_snapshots = snapshot_count(cfg.prefix_snapshots, free_bytes=free, snapshot_bytes=snapshot_bytes,
                                       num_slots=num_slots)
        if tp.parallel:  # rank 0's cache hands out snapshot slots every rank holds: the fewest any rank fits
            num_snapshots = _min_over_ranks(num_snapshots, tp)
        if not num_snapshots:
            logger.warning("prefix caching is off: the cache budget leaves no room for one %.1f MiB snapshot slot "
                           "(raise memory_ratio / cpu_cache_bytes, or set prefix_snapshots)", snapshot_bytes / 2**20)
        elif cfg.overlap_schedule and cfg.speculative and not tp.parallel:  # one per request slot (checkpoints.py;
            num_checkpoints = num_slots  # under tp no step is launched ahead: a finish is at its frontier)
    plan_error = None
    try:
        plan = plan_memory(
        budget, page_size=cfg.page_size, num_slots=num_slots, max_model_len=max_model_len,
        kv_bytes_per_token=kv_bytes_per_token(local_cfg, dtype, mtp_kv, mtp_cfg=target_cfg),
        state_bytes_per_slot=state_bytes,
        draft_bytes_per_slot=ring_bytes + window_bytes, workspace_bytes=workspace,
        budget_field="memory_ratio" if device.type == "cuda" else "cpu_cache_bytes",
        num_snapshots=num_snapshots + num_checkpoints, snapshot_bytes=snapshot_bytes,
        activation_bytes=activations, graph_pool_bytes=graph_pools_bytes,
        device_total_bytes=torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
    except ConfigError as e:
        if not tp.parallel:
            raise
        plan_error = e
    if tp.parallel:  # every rank holds the pages rank 0's scheduler hands out: the fewest any rank fits
        pages = _min_over_ranks(0 if plan_error is not None else plan.num_pages, tp)  # every rank reaches this
        if plan_error is not None:
            raise plan_error
        if not pages:
            raise ConfigError(f"tensor_parallel_size={tp.size}: another rank's cache budget holds no KV page (its "
                              "error, naming what to change, is in its log)")
        plan = replace(plan, num_pages=pages)
    log_plan(plan, draft_ring_bytes=ring_bytes, draft_window_bytes=window_bytes)
    pools = CachePools(local_cfg, plan.num_pages, cfg.page_size, num_slots, k + 1, dtype, device,
                       mtp=mtp_kv, mtp_cfg=target_cfg)
    proposer = None
    if draft is not None:
        proposer = FastDFlashProposer(draft, num_slots, num_snapshots=num_snapshots + num_checkpoints,
                                      rebuild_group=rebuild_group(draft_cfg, cfg.max_num_batched_tokens))
    elif mtp is not None:
        proposer = FastMTPProposer(mtp, pools, num_snapshots=num_snapshots + num_checkpoints)
    snapshots = StateSnapshots(pools, proposer, num_snapshots + num_checkpoints) if num_snapshots else None
    return LoadedModel(cfg, target_cfg, target, pools, proposer, k, max_model_len, plan, tokenizer,
                       stop_token_ids, snapshots, num_checkpoints, load)


def _min_over_ranks(value: int, tp: TPGroup) -> int:
    """The minimum of ``value`` over the ranks, over the host group (gloo): a rank that died makes this raise on the
    others rather than wait in a device collective."""
    count = torch.tensor([value])
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=tp.host_group)
    return int(count.item())


def check_tp_target(cfg: EngineConfig) -> None:
    """Before any rank is spawned: a target tensor parallelism can cut into ``tensor_parallel_size`` ranks (every
    head count and width divisible: ``rank_config`` names the field), and not a GGUF-quantized file."""
    if cfg.tensor_parallel_size == 1:
        return
    if is_gguf_path(cfg.model_path):
        raise ConfigError(f"tensor_parallel_size={cfg.tensor_parallel_size}: expected 1 with a GGUF target "
                          f"({cfg.model_path!r}): its quantized matrices are not cut across ranks yet")
    rank_config(target_config(cfg.model_path), cfg.tensor_parallel_size)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
