"""The cache pools of the batched target and its MTP head: paged K/V, GDN state slots, verify scratch.

Paged K/V (full-attention layers and the MTP layer). Each layer keeps keys and values as flat slot
tensors ``[num_pages * page_size, Hkv, D]``: position p of a sequence lives at slot
``block_table[p // page_size] * page_size + p % page_size``. Keys are stored after RoPE. One extra
row past the end (the trash row) takes the writes of padding rows (``PAD_SLOT``), so a write is one
sync-free ``index_copy_`` and no visible slot changes.

The MTP head has its own paged K/V with the same page tables and slots as the target: the MTP pair
``(h_p, t_{p+1})`` sits at position p and writes slot(p). It lags the target by one position in
time, not in layout: the pair at p can only run once ``t_{p+1}`` is known, so after a step that ran
the target over positions a..b (and sampled ``t_{b+1}``), the MTP runs the pairs at a..b with the
same ``kv_slot_mapping``. Chained drafts write slot(p+1), slot(p+2), ..., which the target's next
verify then also writes in its own tensors; after the verify, the MTP re-runs the accepted
positions with the target's hidden states, overwriting its draft-time rows. Nothing is freed: rows
past a sequence's ``context_lens`` are never read.

GDN state slots (linear-attention layers), one slot per running sequence (plus a trash slot past
the end, written by padding sequences): ``conv [num_slots, conv_dim, K-1]`` (the last K-1 conv
inputs, oldest first, in the pool dtype) and ``recurrent [num_slots, Hv, Dk, Dv]`` (always fp32).

Verify scratch (GDN rollback by replay). A verify step runs ``[anchor, drafts]`` (up to
``max_verify_rows`` rows per sequence) without touching the slots, so each slot keeps its pre-step
state; for the sequence at batch index b and its row r it stores the row's recurrence inputs in
``verify_rows`` (a ``VerifyRowInputs``: k fp32 ``[b, r, Hk, Dk]``, v ``[b, r, Hv, Dv]`` in the pool
dtype, g and beta fp32 ``[b, r, Hv]``) and the row's conv input in ``verify_conv_inputs[b, r]``.
The speculative commit (``fast/speculative/commit.py``) then installs the state after row ``num_rows_kept - 1``: the recurrent state
by replaying rows 0 .. kept-1 on the slot's state (``S'_r = exp(g_r) S``, ``u_r = beta_r (v_r -
S'_r^T k_r)``, ``S = S'_r + k_r u_r^T``: fast/kernels/gdn/gdn_commit.py), the conv state as the last K-1
entries of [pre-step conv state ; inputs of rows 0..kept-1]. Inputs instead of per-row states keep
the scratch small: per row and layer ``Hk Dk + 2 Hv`` fp32 and ``Hv Dv`` pool-dtype recurrence
inputs plus ``Cd`` conv inputs, 32.25 KiB at the MoE shape (Hv = 32, Hk = 16, Dk = Dv = 128, bf16;
half of it the conv input) where one state is 2 MiB. The GDN tensors of all layers are allocated
stacked on a leading layer axis (:class:`GDNStack`; each layer's :class:`GDNSlots` are views), so
the commit of every layer is one kernel launch on CUDA.

Fresh buffers are zeros, or NaN with ``poison=True`` (tests: a read of memory nobody wrote turns
the output into NaN).
"""

from __future__ import annotations


import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from ..kernels.gdn.gdn_recurrent import VerifyRowInputs
from .batch import ForwardBatch



def kv_bytes_per_token(cfg: TargetConfig, dtype: torch.dtype, mtp: bool, mtp_cfg: TargetConfig | None = None) -> int:
    """K and V bytes one token takes across the full-attention layers (and the MTP layer, whose heads are
    ``mtp_cfg``'s: a tensor-parallel rank 0 holds the unsharded MTP layer beside its shard; default ``cfg``)."""
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * _itemsize(dtype)
    mtp_cfg = mtp_cfg or cfg
    mtp_layer = 2 * mtp_cfg.num_key_value_heads * mtp_cfg.head_dim * _itemsize(dtype)
    return len(cfg.full_attention_layers) * per_layer + (mtp_layer if mtp else 0)


def gdn_bytes_per_slot(cfg: TargetConfig, dtype: torch.dtype) -> int:
    """Conv and recurrent bytes of one GDN state slot across the linear-attention layers."""
    conv = cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * _itemsize(dtype)
    recurrent = _recurrent_elems(cfg) * 4
    return len(cfg.linear_attention_layers) * (conv + recurrent)


def verify_bytes_per_seq(cfg: TargetConfig, dtype: torch.dtype, max_verify_rows: int) -> int:
    """Verify scratch bytes of one sequence: every row's recurrence inputs (k, g, beta fp32, v in ``dtype``)
    and conv input, across the linear-attention layers."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    inputs = hk * cfg.linear_key_head_dim * 4 + hv * cfg.linear_value_head_dim * _itemsize(dtype) + 2 * hv * 4
    row = inputs + cfg.gdn_conv_dim * _itemsize(dtype)
    return len(cfg.linear_attention_layers) * max_verify_rows * row


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _recurrent_elems(cfg: TargetConfig) -> int:
    return cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim


def _fresh(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, poison: bool) -> Tensor:
    return torch.full(shape, float("nan") if poison else 0.0, dtype=dtype, device=device)


class PagedKV:
    """One attention layer's paged keys and values; ``keys``/``values`` are the visible slots."""

    def __init__(self, num_kv_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, poison: bool):
        shape = (num_kv_slots + 1, kv_heads, head_dim)  # + the trash row
        self.key_storage = _fresh(shape, dtype, device, poison)
        self.value_storage = _fresh(shape, dtype, device, poison)
        self.num_kv_slots = num_kv_slots

    @property
    def keys(self) -> Tensor:
        return self.key_storage[:self.num_kv_slots]  # [num_pages * page_size, Hkv, D]

    @property
    def values(self) -> Tensor:
        return self.value_storage[:self.num_kv_slots]  # [num_pages * page_size, Hkv, D]

    def write(self, write_index: Tensor, k: Tensor, v: Tensor) -> None:
        """Store rows ``k, v [N, Hkv, D]`` at ``write_index [N]`` (padding rows point at the trash row)."""
        self.key_storage.index_copy_(0, write_index, k.to(self.key_storage.dtype))
        self.value_storage.index_copy_(0, write_index, v.to(self.value_storage.dtype))


class GDNStack:
    """Every linear-attention layer's state slots and verify scratch, stacked on a leading layer axis L
    (``[L, ...]``, L = number of GDN layers in ``cfg.linear_attention_layers`` order) so that
    the verify commit is one launch for all layers; :class:`GDNSlots` are views of one layer."""

    def __init__(self, cfg: TargetConfig, num_slots: int, max_verify_seqs: int, max_verify_rows: int,
                 dtype: torch.dtype, device: torch.device, poison: bool):
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim, taps = cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1
        layers = len(cfg.linear_attention_layers)
        self.num_slots = num_slots
        self.conv_storage = _fresh((layers, num_slots + 1, conv_dim, taps), dtype, device, poison)  # + trash slot
        self.recurrent_storage = _fresh((layers, num_slots + 1, hv, dk, dv), torch.float32, device, poison)
        scratch = (layers, max_verify_seqs, max_verify_rows)
        self.verify_conv_inputs = _fresh((*scratch, conv_dim), dtype, device, poison)
        self.verify_rows = VerifyRowInputs(k=_fresh((*scratch, hk, dk), torch.float32, device, poison),
                                           v=_fresh((*scratch, hv, dv), dtype, device, poison),
                                           g=_fresh((*scratch, hv), torch.float32, device, poison),
                                           beta=_fresh((*scratch, hv), torch.float32, device, poison))


class GDNSlots:
    """One linear-attention layer's state slots and verify scratch: layer ``i`` of a :class:`GDNStack`."""

    def __init__(self, stack: GDNStack, i: int):
        self.num_slots = stack.num_slots
        self.conv_storage = stack.conv_storage[i]  # [num_slots + 1, conv_dim, K-1]: + the trash slot
        self.recurrent_storage = stack.recurrent_storage[i]  # [num_slots + 1, Hv, Dk, Dv] fp32
        self.verify_conv_inputs = stack.verify_conv_inputs[i]  # [max_verify_seqs, max_verify_rows, conv_dim]
        self.verify_rows = VerifyRowInputs(*(t[i] for t in stack.verify_rows))  # [max_verify_seqs, R, ...] each

    @property
    def conv(self) -> Tensor:
        return self.conv_storage[:self.num_slots]  # [num_slots, conv_dim, K-1]

    @property
    def recurrent(self) -> Tensor:
        return self.recurrent_storage[:self.num_slots]  # [num_slots, Hv, Dk, Dv] fp32

    def read_recurrent(self, state_index: Tensor, zero_state: Tensor) -> Tensor:
        """The step's starting recurrent states, fp32 ``[B, Hv, Dk, Dv]``; zeros for ``zero_state``.

        ``torch.where`` rather than a multiply, so a NaN in an ignored slot is never read.
        """
        return torch.where(zero_state[:, None, None, None], 0.0, self.recurrent_storage[state_index])


class CachePools:
    """Every cache tensor of the target (and its MTP head), allocated once at startup.

    ``attention[layer]``: :class:`PagedKV` per full-attention layer (target layer index);
    ``mtp``: the MTP layer's :class:`PagedKV` (None without an MTP head or with ``mtp=False``);
    ``gdn[layer]``: :class:`GDNSlots` per linear-attention layer, views of ``gdn_stack`` (:class:`GDNStack`).
    Verify scratch is indexed by the sequence's position b in the verify batch, so ``max_verify_seqs``
    (default ``num_slots``) bounds B.
    """

    def __init__(self, cfg: TargetConfig, num_pages: int, page_size: int, num_slots: int, max_verify_rows: int,
                 dtype: torch.dtype, device: torch.device | str, *, max_verify_seqs: int | None = None,
                 mtp: bool | None = None, mtp_cfg: TargetConfig | None = None, poison: bool = False):
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("num_slots", num_slots),
                            ("max_verify_rows", max_verify_rows)):
            if value < 1:
                raise ValueError(f"{name}={value}: expected a positive integer")
        device = torch.device(device)
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.num_pages, self.page_size, self.num_slots = num_pages, page_size, num_slots
        self.max_verify_rows = max_verify_rows
        self.max_verify_seqs = num_slots if max_verify_seqs is None else max_verify_seqs
        self.has_mtp = bool(cfg.mtp_num_hidden_layers) if mtp is None else mtp
        if self.has_mtp and not cfg.mtp_num_hidden_layers:
            raise ValueError("mtp=True, but the target has no MTP head (mtp_num_hidden_layers=0)")
        kv_shape = (self.num_kv_slots, cfg.num_key_value_heads, cfg.head_dim)
        self.attention = {layer: PagedKV(*kv_shape, dtype, device, poison) for layer in cfg.full_attention_layers}
        self.mtp_cfg = mtp_cfg or cfg  # the MTP layer's heads (a tensor-parallel rank 0: the unsharded layer's)
        mtp_shape = (self.num_kv_slots, self.mtp_cfg.num_key_value_heads, self.mtp_cfg.head_dim)
        self.mtp = PagedKV(*mtp_shape, dtype, device, poison) if self.has_mtp else None
        self.gdn_stack = GDNStack(cfg, num_slots, self.max_verify_seqs, max_verify_rows, dtype, device, poison)
        self.gdn = {layer: GDNSlots(self.gdn_stack, i) for i, layer in enumerate(cfg.linear_attention_layers)}

    @property
    def num_kv_slots(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.cfg, self.dtype, self.has_mtp, self.mtp_cfg)

    def bytes_per_slot(self) -> int:
        return gdn_bytes_per_slot(self.cfg, self.dtype)

    def verify_scratch_bytes(self) -> int:
        return self.max_verify_seqs * verify_bytes_per_seq(self.cfg, self.dtype, self.max_verify_rows)

    def state_index(self, state_slots: Tensor) -> Tensor:
        """Slot to read and write per sequence; padding sequences go to the trash slot  # [B] long."""
        return torch.where(state_slots < 0, self.num_slots, state_slots).long()

    def kv_write_index(self, kv_slot_mapping: Tensor) -> Tensor:
        """Flat K/V row to write per row; padding rows go to the trash row  # [N] long."""
        return torch.where(kv_slot_mapping < 0, self.num_kv_slots, kv_slot_mapping).long()


def zero_state_mask(batch: ForwardBatch) -> Tensor:
    """Sequences that start from the zero GDN state: first row at position 0, or padding  # [B] bool."""
    first_rows = batch.cu_seqlens[:-1].long().clamp(max=batch.positions.shape[0] - 1)
    starts_at_zero = (batch.positions[first_rows] == 0) & (batch.seq_lens > 0)
    return starts_at_zero | (batch.state_slots < 0)
