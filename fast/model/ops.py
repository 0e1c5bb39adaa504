"""The hook for GPU kernels: every compute op the fast models call that a kernel may replace.

The models never call these functions directly; they call the fields of the :class:`ModelOps`
they were built with. :data:`DEFAULT_OPS` holds the default ops: the plain torch forms (CPU and
CUDA, the forms the conformance tests hold to the reference), except where an op has a kernel,
whose default sends CUDA tensors to it and everything else to the torch form
(``gated_delta_rule``: fast/kernels/gdn_recurrent.py and gdn_prefill.py; ``paged_attention``:
fast/kernels/paged_attention.py for decode and verify steps; ``moe_experts``: fast/kernels/moe.py
for decode and verify steps). Other kernels plug in with the same signatures (token-major rows at
the boundary, :class:`StepMeta` for the sequence layout). Fused kernels that replace a sequence of
these ops, not one op, are chosen inside the modules on CUDA: with the default ``causal_conv1d``,
a GDN decode or verify step runs the conv, the gates and the L2 norms as one prologue kernel
(fast/kernels/gdn_prologue.py), and the norms, RoPE and output gate have fused kernels too;
``replace(DEFAULT_OPS, gated_delta_rule=gated_delta_rule_torch)`` keeps the torch form on CUDA too.

- ``paged_attention(q [N, H, D], key_cache [S, Hkv, D], value_cache [S, Hkv, D], meta) -> [N, H, D]``
- ``causal_conv1d(x [N, Cd], conv_state [B, Cd, K-1], weight [Cd, K], meta) -> (silu(y) [N, Cd], state [B, Cd, K-1])``
- ``gated_delta_rule(q [N, Hk, Dk], k [N, Hk, Dk], v [N, Hv, Dv], g [N, Hv], beta [N, Hv],
  state [B, Hv, Dk, Dv], meta, verify_rows [B', R, ...] | None) -> (o [N, Hv, Dv], state [B, Hv, Dk, Dv])``
  (``verify_rows``: a ``VerifyRowInputs`` that receives every verify row's k, v, g, beta)
- ``moe_experts(x [N, C], expert_ids [N, k], weights [N, k], gate_up [E, 2I, C], down [E, C, I]) -> [N, C] fp32``
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .attention import paged_attention
from .gdn import causal_conv1d_torch, gated_delta_rule
from .moe import moe_experts


@dataclass(frozen=True)
class ModelOps:
    paged_attention: Callable = paged_attention
    causal_conv1d: Callable = causal_conv1d_torch
    gated_delta_rule: Callable = gated_delta_rule
    moe_experts: Callable = moe_experts


DEFAULT_OPS = ModelOps()
