"""The commit of a verify step: the target's GDN state after the last kept row (twin of the rollback in
``reference/speculative/loop.verify_step``, which re-runs the kept rows from a snapshot).

A verify forward leaves every GDN slot at its pre-step state and stores the rows' inputs in the verify
scratch (``fast/model/pools.py``). :func:`commit_verify` replays the kept rows on the slot's state, every GDN
layer at once (``kernels/gdn/gdn_commit``: one kernel on CUDA, its torch twin elsewhere). Paged K/V and the
DFlash ring need no rollback: rows past the committed frontier are never read and get overwritten.
"""

from __future__ import annotations

from torch import Tensor

from ..kernels.gdn.gdn_commit import gdn_commit
from ..model.batch import ForwardBatch
from ..model.pools import CachePools, zero_state_mask
from ..model.step import StepMeta


def commit_verify(pools: CachePools, batch: ForwardBatch, num_rows_kept: Tensor, meta: StepMeta | None = None) -> None:
    """Install, per sequence, the GDN state after its row ``num_rows_kept[b] - 1`` of the verify ``batch``.

    ``batch`` is the verify batch the forward ran (same sequence order); ``num_rows_kept [B]`` is
    ``num_accepted + 1`` (the anchor and the accepted drafts), each in 1 .. rows of its sequence.
    ``meta``, the forward's ``StepMeta`` of ``batch`` (its output's ``meta``), saves recomputing the slots and
    the zero-state mask (a captured step's small kernels).
    """
    kept = num_rows_kept.to(pools.device)  # [B] integer (the kernel reads any; the torch form makes it long)
    stack = pools.gdn_stack
    if meta is None:
        state_index, zero_state = pools.state_index(batch.state_slots), zero_state_mask(batch)
    else:
        state_index, zero_state = meta.state_index, meta.zero_state
    gdn_commit(stack.conv_storage, stack.recurrent_storage, stack.verify_conv_inputs, stack.verify_rows, state_index,
               zero_state, kept)
