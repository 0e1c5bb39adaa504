"""The engine's tensor-parallel ranks (``EngineConfig.tensor_parallel_size`` > 1), as vLLM's and SGLang's TP workers.

The process that owns the :class:`~dflash2.fast.engine.engine.Engine` is **rank 0**: it runs the scheduler, the
sampling, the commits, everything it does at tp=1, over its own shard of the target (``FastTarget`` with a
:class:`~dflash2.fast.parallel.TPGroup`). At startup it spawns ranks 1..tp-1 (:func:`start_workers`:
``torch.multiprocessing`` spawn, a free local port, ``init_process_group`` over gloo on the CPU, NCCL on CUDA
with rank r on ``cuda:r``); each builds its own shard and cache pools by the same ``load_model`` (pools from the
rank's ``local_cfg``, the page count the minimum over the ranks) and then loops in :func:`worker_main`.

What is broadcast, and when: the only per-rank state a plain-decoding step changes is the rank's cache pools (KV
pages and GDN state slots), and the only thing that changes them is the target's forward, at indices (pages,
slots) that rank 0's scheduler chose and that travel inside the ``ForwardBatch``. So the seam is the eager
forward (``EagerStep.forward``): before rank 0 runs ``target.forward(batch, pools)`` it broadcasts
``("forward", batch)`` (the batch's tensors on the host) over a gloo group; every worker runs the same forward on
its pools, and the all-reduces and all-gathers inside the layers pair up across the ranks. Frees of slots and pages
are host bookkeeping of rank 0's scheduler (a freed slot's state is never read: a sequence at position 0 starts
from zeros), so nothing else is sent. ``("stop",)`` ends the loop (:meth:`TPWorkers.close`).

Under tp > 1 for now: plain decoding only (``speculative_algorithm`` 'none'; ``EngineConfig`` refuses the rest),
every step eager (no CUDA graphs), no prefix caching (its snapshot copies are per-rank state ops that would need
their own messages), no GGUF-quantized target (``fast/model/params.py`` cannot cut quantized blocks). Each is
forced or refused at startup with its reason.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import fields, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...model.batch import ForwardBatch
from ...parallel.group import TPGroup
from ..config import EngineConfig
from ..startup import load_model

logger = logging.getLogger("dflash2.fast.engine")

JOIN_SECONDS = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, size: int, port: int, device: str) -> tuple[TPGroup, object]:
    """Join the group; returns (the rank's TPGroup, the gloo group the control messages go over)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    control = dist.new_group(backend="gloo") if backend == "nccl" else None  # objects travel over the CPU
    return TPGroup.from_process_group(), control


def _host_batch(batch: ForwardBatch) -> ForwardBatch:
    return replace(batch, **{f.name: getattr(batch, f.name).cpu() for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def _device_batch(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    return replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


class TPWorkers:
    """Rank 0's handle on ranks 1..tp-1: ``tp`` (its TPGroup), :meth:`forward` (broadcast a step's batch before
    rank 0's own forward) and :meth:`close` (stop the workers, join them, leave the group)."""

    def __init__(self, processes: list, tp: TPGroup, control):
        self.processes, self.tp, self.control = processes, tp, control
        self.closed = False

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def forward(self, batch: ForwardBatch) -> None:
        """Before rank 0's ``target.forward(batch, pools)``: every worker runs the same forward on its shard."""
        self._send(("forward", _host_batch(batch)))

    def close(self) -> None:
        """Stop the workers (they exit their loop), join them and destroy the process group; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.processes):
                self._send(("stop",))
        finally:
            for p in self.processes:
                p.join(JOIN_SECONDS)
                if p.is_alive():
                    logger.warning("tensor-parallel worker pid %d did not exit in %.0f s: terminated", p.pid,
                                   JOIN_SECONDS)
                    p.terminate()
                    p.join(JOIN_SECONDS)
            if dist.is_initialized():
                dist.destroy_process_group()


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
    """Rank ``rank`` > 0: build the shard and its pools, then run every forward rank 0 broadcasts until "stop"."""
    if config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    tp, control = _init(rank, size, port, config.device)
    try:
        model = load_model(config, tp=tp)  # on cuda:rank under CUDA
        target, pools, device = model.target, model.pools, model.pools.device
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            message = box[0]
            if message[0] == "stop":
                break
            if message[0] == "forward":
                target.forward(_device_batch(message[1], device), pools)
            else:
                raise RuntimeError(f"tensor-parallel rank {rank}: unknown message {message[0]!r}")
    finally:
        dist.destroy_process_group()
