"""The tensor-parallel group of one rank: who it is and the two collectives the sharded target needs.

``all_reduce`` sums a row-parallel projection's partial outputs (``y = sum_r W[:, cols_r] x[cols_r]``);
``all_gather`` concatenates the vocabulary slices of the logits. At size 1 both are the identity and
touch no process group, so a tp=1 target runs exactly the ops it ran before tensor parallelism existed.
The same calls run over gloo (CPU) and NCCL (CUDA): torch.distributed picks by the group's backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (size > 1) or no group at all (size 1)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup rank={self.rank}, size={self.size}: expected 0 <= rank < size, size >= 1")

    @classmethod
    def single(cls) -> TPGroup:
        """tp=1: no communication."""
        return cls()

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None) -> TPGroup:
        """This process's rank in ``group`` (default: the world group; ``init_process_group`` must have run)."""
        if not dist.is_initialized():
            raise RuntimeError("TPGroup.from_process_group: torch.distributed is not initialised "
                               "(call init_process_group first)")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the ranks, in place (x is the fresh output of a projection); x at size 1."""
        if self.size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """``cat([x_0, ..., x_{size-1}], dim)``, every rank's ``x`` (same shape) in rank order; x at size 1."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
