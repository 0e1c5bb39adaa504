"""The tensor-parallel group of one rank: who it is and the two collectives the sharded target needs.

``all_reduce`` sums a row-parallel projection's partial outputs (``y = sum_r W[:, cols_r] x[cols_r]``);
``all_gather`` concatenates the vocabulary slices of the logits. At size 1 both are the identity and
touch no process group, so a tp=1 target runs exactly the ops it ran before tensor parallelism existed.
On the CPU both go through torch.distributed (gloo); on CUDA through a raw NCCL communicator
(``parallel/nccl.py``), which a CUDA graph can capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .nccl import NcclComm


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (size > 1) or no group at all (size 1)
    # CUDA: the capture-safe communicator (parallel/nccl.py) the collectives go through instead of ``group``, so a
    # CUDA graph of a sharded step replays them; None: torch.distributed over ``group`` (gloo on the CPU)
    nccl: NcclComm | None = None
    # a CPU (gloo) group over the same ranks for host-side reductions (startup's counts): None, ``group`` itself,
    # which is gloo wherever no separate one is given
    host: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup rank={self.rank}, size={self.size}: expected 0 <= rank < size, size >= 1")

    @classmethod
    def single(cls) -> TPGroup:
        """tp=1: no communication."""
        return cls()

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None, nccl: NcclComm | None = None,
                           host: dist.ProcessGroup | None = None) -> TPGroup:
        """This process's rank in ``group`` (default: the world group; ``init_process_group`` must have run)."""
        if not dist.is_initialized():
            raise RuntimeError("TPGroup.from_process_group: torch.distributed is not initialised "
                               "(call init_process_group first)")
        return cls(dist.get_rank(group), dist.get_world_size(group), group, nccl, host)

    @property
    def host_group(self) -> dist.ProcessGroup | None:
        """The group for reductions of CPU tensors."""
        return self.host if self.host is not None else self.group

    def close(self) -> None:
        """Destroy the NCCL communicator, if any (the process group is torch.distributed's to destroy)."""
        if self.nccl is not None:
            self.nccl.close()

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the ranks, in place (x is the fresh output of a projection); x at size 1."""
        if self.size == 1:
            return x
        if self.nccl is not None:
            return self.nccl.all_reduce(x)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """``cat([x_0, ..., x_{size-1}], dim)``, every rank's ``x`` (same shape) in rank order; x at size 1."""
        if self.size == 1:
            return x
        if self.nccl is not None:
            return torch.cat(self.nccl.all_gather(x.contiguous()).unbind(0), dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
