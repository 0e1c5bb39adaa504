"""The sparse MoE with its gated shared expert (twin of reference/model/moe.py), batched over all rows.

    probs = softmax(W_router x) in fp32;  top-k experts, weights renormalised over the k
    y     = sum_{e in top} w_e W_down[e](silu(W_gate[e] x) * W_up[e] x) + sigmoid(w_sg . x) swiglu_shared(x)

The routed experts are an op (:attr:`ModelOps.moe_experts`). Its torch form groups the (row,
choice) pairs by expert and runs one matmul pair per expert that has rows (a loop over experts,
never over requests); it reads the per-expert counts on the host, one device sync per layer.
:func:`moe_experts`, the op's default, sends CUDA tensors of up to ``MAX_TRITON_PAIRS`` (row,
choice) pairs (decode and verify steps) to the sync-free, graph-capturable Triton kernels
(fast/kernels/moe.py), as it does any size inside a CUDA-graph capture; everything else (CPU, long
prefills) goes to the torch form. The router (softmax, top-k, renormalise) is :func:`route`: CUDA
tensors of up to ``MAX_TRITON_ROUTE_ROWS`` rows (and any size inside a capture) to the two Triton
kernels of fast/kernels/moe_router.py, everything else to their torch twin. Where the shared expert
has the routed experts' width, a decode or verify step on CUDA runs the whole sublayer as those four
kernels, the shared expert as one more pair (:class:`FastMoE`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from ..kernels.moe import MAX_TRITON_PAIRS, moe_experts_triton
from ..kernels.moe_router import route_torch, route_triton
from ..kernels.triton_compat import use_triton
from .mlp import swiglu
from .params import Params


def moe_experts_torch(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Weighted sum of each row's chosen experts.

    x: ``[N, C]``; expert_ids: ``[N, k]`` long; weights: fp32 ``[N, k]``; gate_up: ``[E, 2I, C]``
    (gate rows first); down: ``[E, C, I]``. Returns fp32 ``[N, C]``, the experts added in
    ascending expert order per row.
    """
    num_experts, top_k = gate_up.shape[0], expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [N k]
    order = torch.argsort(flat, stable=True)  # (row, choice) pairs grouped by expert
    rows = order // top_k
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # host sync: the group sizes
    xs = x[rows]  # [N k, C]
    outs = torch.empty(xs.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            outs[start:start + count] = swiglu(xs[start:start + count], gate_up[e], down[e]).float()
            start += count
    weighted = outs * weights.reshape(-1)[order, None]  # [N k, C]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, rows, weighted)


def moe_experts(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """``moe_experts_torch``'s contract; by the Triton kernels (no host sync) for CUDA tensors of at
    most ``MAX_TRITON_PAIRS`` (row, choice) pairs, and of any size inside a CUDA-graph capture."""
    if use_triton(x, expert_ids, weights, gate_up, down) and (
            expert_ids.numel() <= MAX_TRITON_PAIRS or torch.cuda.is_current_stream_capturing()):
        return moe_experts_triton(x, expert_ids, weights, gate_up, down)
    return moe_experts_torch(x, expert_ids, weights, gate_up, down)


MAX_TRITON_ROUTE_ROWS = 512  # above (long prefills) cuBLAS's GEMM, not the kernel's CUDA-core products (unmeasured)


def route(x: Tensor, w_router: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """``route_torch``'s contract, ``(expert_ids [N, k] int64, weights [N, k] fp32)``; by the Triton
    kernels (no host sync) for CUDA tensors of at most ``MAX_TRITON_ROUTE_ROWS`` rows, and of any
    size inside a CUDA-graph capture."""
    if use_triton(x, w_router) and (
            x.shape[0] <= MAX_TRITON_ROUTE_ROWS or torch.cuda.is_current_stream_capturing()):
        return route_triton(x, w_router, top_k)
    return route_torch(x, w_router, top_k)


# Rows up to which the shared expert runs as the (k+1)-th pair: one chunk of the MoE kernel's 16 rows. Past it,
# one program per I tile walks all the shared expert's rows chunk by chunk (the kernel's design), where cuBLAS
# runs them as one GEMM: with the pair at every size, the MoE shape's DFlash step at 16 requests x 8 verify
# rows (128 rows) went from 35.7 to 42.1 ms on the H200 while every other step got faster
# (bench/results/2026-12-01-h200-perf2/; not profiled, and this threshold is not yet measured).
SHARED_PAIR_ROWS = 16


def stack_rows(first: Tensor, last: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``cat([first, last[None]])`` built in place on ``device`` in ``dtype``  # [E, ...], [...] -> [E + 1, ...].

    Copied into one fresh buffer, so no E-expert copy of the weights stays alive beside it."""
    out = torch.empty((first.shape[0] + 1, *first.shape[1:]), dtype=dtype, device=device)
    out[:-1].copy_(first.detach())
    out[-1].copy_(last.detach())
    return out


class FastMoE:
    """The MoE sublayer, reading ``{prefix}mlp.*``.

    Where the shared expert is as wide as a routed one (Is = I, as in the released Qwen3.5-MoE
    models) it is stored as expert E after the E routed ones (``gate_up [E + 1, 2I, C]``,
    ``down [E + 1, C, I]``) and its gate vector as row E of the router (``[E + 1, C]``). A decode
    or verify step on CUDA then runs the whole sublayer as four kernels: the router appends the
    shared expert to each row's choices with weight sigmoid(w_sg . x), and the routed-expert kernels
    run it as a (k+1)-th pair, summing in fp32 and rounding once to the model dtype. That is for
    at most ``SHARED_PAIR_ROWS`` rows (decode and verify steps of a few requests); everything else
    (more rows, the CPU, a replaced ``moe_experts`` op, prefills) runs the module docstring's form
    on views of the first E experts, bit for bit as before.
    """

    def __init__(self, cfg: TargetConfig, params: Params, prefix: str, moe_experts):
        p = f"{prefix}mlp."
        self.top_k = cfg.num_experts_per_tok
        self.moe_experts = moe_experts
        device = params.device
        num_experts = cfg.num_experts
        w_router = params.raw(f"{p}gate.weight")  # [E, C]
        gate_up = params.raw(f"{p}experts.gate_up_proj")  # [E, 2I, C]
        down = params.raw(f"{p}experts.down_proj")  # [E, C, I]
        self.shared_gate_up = params.fused(f"{p}shared_expert.gate_proj.weight",
                                           f"{p}shared_expert.up_proj.weight")  # [2Is, C]
        shared_down = params.raw(f"{p}shared_expert.down_proj.weight")  # [C, Is]
        shared_gate = params.raw(f"{p}shared_expert_gate.weight")  # [1, C]
        self.shared_as_expert = self.shared_gate_up.shape == gate_up.shape[1:]
        if self.shared_as_expert:
            self.router_with_shared = stack_rows(w_router, shared_gate[0], torch.float32, device)  # [E + 1, C]
            self.gate_up_with_shared = stack_rows(gate_up, self.shared_gate_up, params.dtype, device)
            self.down_with_shared = stack_rows(down, shared_down, params.dtype, device)
            self.w_router = self.router_with_shared[:num_experts]  # routing in fp32
            self.gate_up, self.down = self.gate_up_with_shared[:num_experts], self.down_with_shared[:num_experts]
            self.shared_gate_up = self.gate_up_with_shared[num_experts]  # [2Is, C]
            self.shared_down = self.down_with_shared[num_experts]  # [C, Is]
            self.shared_expert_gate = self.router_with_shared[num_experts:].to(params.dtype)  # [1, C]
            # the overlapped split form's per-expert counters (fast/kernels/moe.py): zero, and left zero by every call
            self.ready = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
        else:
            self.w_router = params.get(f"{p}gate.weight", torch.float32)  # [E, C], routing in fp32
            self.gate_up = params.get(f"{p}experts.gate_up_proj")  # [E, 2I, C]
            self.down = params.get(f"{p}experts.down_proj")  # [E, C, I]
            self.shared_down = params.get(f"{p}shared_expert.down_proj.weight")  # [C, Is]
            self.shared_expert_gate = params.get(f"{p}shared_expert_gate.weight")  # [1, C]

    def _fused(self, x: Tensor) -> bool:
        """Whether this call runs the four-kernel form (class docstring): at most ``SHARED_PAIR_ROWS`` rows."""
        return (self.shared_as_expert and self.moe_experts is moe_experts and use_triton(x)
                and x.shape[0] <= SHARED_PAIR_ROWS)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[N, C]`` after post_attention_layernorm. Returns ``[N, C]`` in x's dtype."""
        if self._fused(x):
            return self.forward_four_kernels(x)
        expert_ids, weights = route(x, self.w_router, self.top_k)  # [N, k] int64, [N, k] fp32
        routed = self.moe_experts(x, expert_ids, weights, self.gate_up, self.down)  # [N, C] fp32
        shared = torch.sigmoid(x @ self.shared_expert_gate.T) * swiglu(x, self.shared_gate_up, self.shared_down)
        return (routed + shared.float()).to(x.dtype)

    def forward_four_kernels(self, x: Tensor) -> Tensor:
        """:meth:`forward` by the router and routed-expert kernels, the shared expert as pair k+1
        (needs ``shared_as_expert``; the tests call it on the CPU under Triton's interpreter)."""
        expert_ids, weights = route_triton(x, self.router_with_shared, self.top_k, shared_gate=True)  # [N, k+1]
        return moe_experts_triton(x, expert_ids, weights, self.gate_up_with_shared, self.down_with_shared,
                                  ready=self.ready, out_dtype=x.dtype)
