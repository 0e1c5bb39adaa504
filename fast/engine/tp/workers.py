"""The engine's tensor-parallel ranks (``EngineConfig.tensor_parallel_size`` > 1), as vLLM's and SGLang's TP workers.

The process that owns the :class:`~dflash2.fast.engine.engine.Engine` is **rank 0**: it runs the scheduler, the
proposer (the DFlash draft or the MTP head, unsharded: ``startup.load_model``), the sampling and the verify, over
its own shard of the target (``FastTarget`` with a :class:`~dflash2.fast.parallel.TPGroup`). At startup it spawns
ranks 1..tp-1 (:func:`start_workers`: ``torch.multiprocessing`` spawn, a free local port, ``init_process_group``
over gloo on the CPU, NCCL on CUDA with rank r on ``cuda:r``); each builds its own shard and cache pools by the
same ``load_model`` (pools from the rank's ``local_cfg``; the page and snapshot counts the minimum over the ranks)
and then loops in :func:`worker_main`.

What is sent, and when: a worker's only state is its cache pools (KV pages, GDN state slots, the verify scratch)
and, with prefix caching, its snapshot slots. Three kinds of operation change them, always at indices (pages,
slots, snapshot slots) rank 0's scheduler chose:

- the target's forward (prefill chunk, decode, verify): the ``ForwardBatch`` carries the indices;
- the commit of a verify step (``speculative/commit.commit_verify``): the batch and each sequence's kept rows;
- the prefix cache's ``save`` / ``load`` / ``copy_pages`` (``engine/snapshots.py``): the slots and pages.

A forward that rank 0 replays from its ``TargetGraphs`` (a decode, a verify's forward) is sent as
``("graph", bounds, key, tokens, run's keywords)``: the worker replays its own ``TargetGraphs`` of the same bounds
(captured on first use, as rank 0's), so the padded buckets and static buffers agree rank by rank. Whole
speculative-step graphs (``StepGraphs``) are not used under tp > 1: they hold the proposer, which is rank 0's.

Rank 0 queues the commits and the snapshot operations (:meth:`TPWorkers.commit`, :class:`MirroredSnapshots`) and
sends the queue with the next forward, as one message (``[op, ..., ("forward", batch)]``) over a gloo group, before
its own forward: a worker applies the ops in rank 0's order, then runs the forward, whose all-reduces and
all-gathers pair up with rank 0's. So a step costs one broadcast, and a worker's pools equal what rank 0's would be at tp=1, rank by rank.
Nothing else needs sending: the proposer's state (DFlash ring and window, MTP pending rows and K/V) lives on rank 0
only, and a freed slot's state is never read (a sequence at position 0 starts from zeros). ``("stop",)`` ends the
loop (:meth:`TPWorkers.close`).

Under tp > 1 for now: no GGUF-quantized target (``fast/model/params.py`` cannot cut quantized blocks), refused at
startup with its reason.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import fields, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from ...model.batch import ForwardBatch
from ...parallel.group import TPGroup
from ...parallel.nccl import NcclComm
from ...speculative.commit import commit_verify
from ..config import EngineConfig
from ..graphs.graph_step import TargetGraphs
from ..snapshots import StateSnapshots
from ..startup import load_model

logger = logging.getLogger("dflash2.fast.engine")

JOIN_SECONDS = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, size: int, port: int, device: str) -> tuple[TPGroup, object]:
    """Join the group; returns (the rank's TPGroup, the gloo group the control messages go over). On CUDA the
    model's collectives go through a raw NCCL communicator (``parallel/nccl.py``: capture-safe), its id sent over
    the gloo group; torch.distributed's NCCL group serves the startup's few host-side reductions."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    control = dist.new_group(backend="gloo") if backend == "nccl" else None  # objects travel over the CPU
    nccl = NcclComm.create(rank, size, torch.device("cuda", rank), control) if backend == "nccl" else None
    return TPGroup.from_process_group(nccl=nccl, host=control), control


def _host_batch(batch: ForwardBatch) -> ForwardBatch:
    return replace(batch, **{f.name: getattr(batch, f.name).cpu() for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def _device_batch(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    return replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


class TPWorkers:
    """Rank 0's handle on ranks 1..tp-1: ``tp`` (its TPGroup), :meth:`forward` (send the queued ops and a step's
    batch before rank 0's own forward), :meth:`commit` and :meth:`snapshots` (queue a state op) and :meth:`close`
    (stop the workers, join them, leave the group)."""

    def __init__(self, processes: list, tp: TPGroup, control):
        self.processes, self.tp, self.control = processes, tp, control
        self.pending: list[tuple] = []  # state ops since the last forward, in rank 0's order
        self.closed = False

    def _send(self, message: list[tuple]) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def forward(self, batch: ForwardBatch) -> None:
        """Before rank 0's ``target.forward(batch, pools)``: every worker applies the queued ops, then runs the
        same forward on its shard."""
        message, self.pending = self.pending + [("forward", _host_batch(batch))], []
        self._send(message)

    def dead(self) -> list[str]:
        """The workers that have exited, as "rank r (exit code c)"."""
        return [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.processes, start=1)
                if not p.is_alive()]

    def graph_run(self, graphs, key, tokens: list[int], run_kwargs: dict) -> None:
        """Before rank 0 replays ``graphs``' capture of ``key`` (``TargetGraphs.run``): every worker applies the
        queued ops, then runs the same ``run`` on its own ``TargetGraphs`` of the same bounds (captured on first
        use there as here)."""
        message, self.pending = self.pending + [("graph", (graphs.max_seqs, graphs.max_pages), key, tokens,
                                                 run_kwargs)], []
        self._send(message)

    def commit(self, batch: ForwardBatch, num_rows_kept: Tensor) -> None:
        """Queue ``commit_verify(pools, batch, num_rows_kept)`` (called beside rank 0's own commit)."""
        self.pending.append(("commit", _host_batch(batch), num_rows_kept.cpu()))

    def snapshots(self, method: str, *args) -> None:
        """Queue ``StateSnapshots.<method>(*args)`` on the workers' snapshot slots (:class:`MirroredSnapshots`)."""
        self.pending.append(("snapshots", method, args))

    def close(self, abort: bool = False) -> None:
        """Stop the workers (they exit their loop), join them and destroy the process group; idempotent. ``abort``
        (a failed startup: a worker may be waiting in a collective rank 0 will never join): terminate them."""
        if self.closed:
            return
        self.closed = True
        try:
            if abort:
                for p in self.processes:
                    p.terminate()
            elif all(p.is_alive() for p in self.processes):
                self._send([("stop",)])
        except RuntimeError as e:  # a worker died first (its own error is on its stderr): join what is left
            logger.warning("tensor-parallel workers: the stop message failed (%s)", e)
        finally:
            for p in self.processes:
                p.join(JOIN_SECONDS)
                if p.is_alive():
                    logger.warning("tensor-parallel worker pid %d did not exit in %.0f s: terminated", p.pid,
                                   JOIN_SECONDS)
                    p.terminate()
                    p.join(JOIN_SECONDS)
            self.tp.close()
            if dist.is_initialized():
                dist.destroy_process_group()


class MirroredSnapshots:
    """Rank 0's :class:`~dflash2.fast.engine.snapshots.StateSnapshots` under tp > 1: each operation is queued for
    the workers' own snapshot slots (their GDN state; the proposer's part is rank 0's alone), then run here."""

    def __init__(self, local: StateSnapshots, workers: TPWorkers):
        self.local, self.workers = local, workers
        self.num_snapshots = local.num_snapshots

    def save(self, slots, snapshots) -> None:
        if slots:
            self.workers.snapshots("save", list(slots), list(snapshots))
        self.local.save(slots, snapshots)

    def load(self, snapshots, slots, frontiers) -> None:
        if slots:
            self.workers.snapshots("load", list(snapshots), list(slots), list(frontiers))
        self.local.load(snapshots, slots, frontiers)

    def copy_pages(self, src_pages, dst_pages) -> None:
        if src_pages:
            self.workers.snapshots("copy_pages", list(src_pages), list(dst_pages))
        self.local.copy_pages(src_pages, dst_pages)


def start_workers(config: EngineConfig) -> TPWorkers:
    """Spawn ranks 1..tp-1 of ``config`` (resolved) and join the group as rank 0."""
    size = config.tensor_parallel_size
    if dist.is_initialized():
        raise RuntimeError("tensor_parallel_size > 1: torch.distributed is already initialised in this process "
                           "(close the other tensor-parallel engine first)")
    port = _free_port()
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, size):
        p = ctx.Process(target=worker_main, args=(rank, size, port, config), daemon=True,
                        name=f"dflash2-tp-rank{rank}")
        p.start()
        processes.append(p)
    try:
        tp, control = _init(0, size, port, config.device)
    except BaseException:
        for p in processes:
            p.terminate()
        raise
    logger.info("tensor parallelism: rank 0 here, ranks 1..%d in processes %s", size - 1,
                [p.pid for p in processes])
    return TPWorkers(processes, tp, control)


def worker_main(rank: int, size: int, port: int, config: EngineConfig) -> None:
    """Rank ``rank`` > 0: build the shard and its pools, then apply every message rank 0 broadcasts until "stop"."""
    if config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    tp, control = _init(rank, size, port, config.device)
    try:
        model = load_model(config, tp=tp)  # on cuda:rank under CUDA; no proposer (rank 0's alone)
        target, pools, snapshots, device = model.target, model.pools, model.snapshots, model.pools.device
        graphs: dict[tuple[int, int], TargetGraphs] = {}  # rank 0's TargetGraphs' twins, by (max_seqs, max_pages)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            for op in box[0]:
                if op[0] == "stop":
                    return
                if op[0] == "forward":
                    target.forward(_device_batch(op[1], device), pools)
                elif op[0] == "graph":
                    bounds, key, tokens, run_kwargs = op[1:]
                    if bounds not in graphs:
                        graphs[bounds] = TargetGraphs(target, pools, max_seqs=bounds[0], max_pages=bounds[1])
                    graphs[bounds].run(key, tokens, **run_kwargs)
                elif op[0] == "commit":
                    commit_verify(pools, _device_batch(op[1], device), op[2])
                elif op[0] == "snapshots":
                    getattr(snapshots, op[1])(*op[2])
                else:
                    raise RuntimeError(f"tensor-parallel rank {rank}: unknown message {op[0]!r}")
    finally:
        tp.close()
        dist.destroy_process_group()
