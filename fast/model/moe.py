"""The sparse MoE with its gated shared expert (twin of reference/model/moe.py), batched over all rows.

    probs = softmax(W_router x) in fp32;  top-k experts, weights renormalised over the k
    y     = sum_{e in top} w_e W_down[e](silu(W_gate[e] x) * W_up[e] x) + sigmoid(w_sg . x) swiglu_shared(x)

The router and the routed experts are ops of ``fast/kernels/moe/`` (``route``, ``moe_experts``: the torch
twin of the experts groups the (row, choice) pairs by expert and reads the per-expert counts on the host,
the kernels are sync-free and capturable). On CUDA both run their kernels at every size: a prefill chunk's
routed experts (more than ``MAX_TRITON_PAIRS`` pairs) the grouped GEMM of ``moe_grouped.py``, the shared
expert beside them by cuBLAS. A GGUF target's experts, kept as their blocks, run ``moe_quantized.py``'s forms
instead (no shared-as-expert layout). Where the shared expert has the routed experts' width, a decode
or verify step on CUDA runs the whole sublayer as four kernels, and a prefill chunk past ``MAX_TRITON_PAIRS``
routed pairs runs the shared expert inside the grouped GEMM as pair k+1 (:data:`moe_sublayer`,
:class:`FastMoE`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.reference.formats.config import TargetConfig

from ..kernels.common.dispatch import GpuForm, KernelOp
from ..kernels.dense.skinny_linear import skinny_linear
from ..kernels.dense.swiglu import swiglu_act
from ..kernels.moe import moe as moe_kernels
from ..kernels.moe import moe_grouped
from ..kernels.moe.moe import moe_experts, moe_experts_triton
from ..kernels.moe.moe_router import route, route_triton
from .linear import linear, swiglu_linear
from .moe_quantized import QuantizedExperts
from .params import Params


# Rows up to which the shared expert runs as the (k+1)-th pair: one chunk of the MoE kernel's 16 rows. Past it,
# one program per I tile walks all the shared expert's rows chunk by chunk (the kernel's design), where cuBLAS
# runs them as one GEMM: with the pair at every size, the MoE shape's DFlash step at 16 requests x 8 verify
# rows (128 rows) got slower while every other step got faster (measured: bench/results/2026-12-01-h200-perf2/;
# not profiled, and this threshold is not yet measured).
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
    at most ``SHARED_PAIR_ROWS`` rows (decode and verify steps of a few requests). A prefill chunk whose
    routed pairs take the grouped GEMM (past ``MAX_TRITON_PAIRS``) runs the shared expert in it the same way
    (:meth:`forward_grouped_with_shared`). Everything else (the rows between, the CPU) runs the module
    docstring's form on views of the first E experts.
    """

    ops = (route, moe_experts, skinny_linear, swiglu_act)  # the kernel ops it runs (FastTarget.capturable)

    def __init__(self, cfg: TargetConfig, params: Params, prefix: str):
        p = f"{prefix}mlp."
        self.top_k = cfg.num_experts_per_tok
        device = params.device
        num_experts = cfg.num_experts
        self.quantized = params.is_quantized(f"{p}experts.gate_up_proj") or params.is_quantized(f"{p}experts.down_proj")
        if self.quantized:  # a GGUF target's experts, kept as their blocks: QuantizedExperts (no shared-as-expert)
            self.shared_as_expert = False
            self.w_router = params.get(f"{p}gate.weight", torch.float32)  # [E, C]
            self.experts = QuantizedExperts(params.weight(f"{p}experts.gate_up_proj"),
                                            params.weight(f"{p}experts.down_proj"), params.dtype)
            self.shared_gate_up = params.fused(f"{p}shared_expert.gate_proj.weight", f"{p}shared_expert.up_proj.weight")
            self.shared_down = params.weight(f"{p}shared_expert.down_proj.weight")  # [C, Is]
            self.shared_expert_gate = params.get(f"{p}shared_expert_gate.weight")  # [1, C]
            self.ops = FastMoE.ops + QuantizedExperts.ops
            return
        w_router = params.raw(f"{p}gate.weight")  # [E, C]
        gate_up_shape = params.shape(f"{p}experts.gate_up_proj")  # [E, 2I, C]
        down_shape = params.shape(f"{p}experts.down_proj")  # [E, C, I]
        self.shared_gate_up = params.fused(f"{p}shared_expert.gate_proj.weight",
                                           f"{p}shared_expert.up_proj.weight")  # [2Is, C]
        shared_down = params.raw(f"{p}shared_expert.down_proj.weight")  # [C, Is]
        shared_gate = params.raw(f"{p}shared_expert_gate.weight")  # [1, C]
        self.shared_as_expert = (isinstance(self.shared_gate_up, Tensor)
                                 and tuple(self.shared_gate_up.shape) == gate_up_shape[1:])
        if self.shared_as_expert:
            self.router_with_shared = stack_rows(w_router, shared_gate[0], torch.float32, device)  # [E + 1, C]
            # the experts land in their final [E + 1, ...] buffers, written in place (Params.into): no E-expert copy
            self.gate_up_with_shared = self._with_shared(params, f"{p}experts.gate_up_proj", gate_up_shape,
                                                         self.shared_gate_up)
            self.down_with_shared = self._with_shared(params, f"{p}experts.down_proj", down_shape, shared_down)
            self.w_router = self.router_with_shared[:num_experts]  # routing in fp32
            self.gate_up, self.down = self.gate_up_with_shared[:num_experts], self.down_with_shared[:num_experts]
            self.shared_gate_up = self.gate_up_with_shared[num_experts]  # [2Is, C]
            self.shared_down = self.down_with_shared[num_experts]  # [C, Is]
            self.shared_expert_gate = self.router_with_shared[num_experts:].to(params.dtype)  # [1, C]
            # the overlapped split form's per-expert counters (fast/kernels/moe/moe.py): zero, and left zero by every call
            self.ready = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
        else:
            self.w_router = params.get(f"{p}gate.weight", torch.float32)  # [E, C], routing in fp32
            self.gate_up = params.get(f"{p}experts.gate_up_proj")  # [E, 2I, C]
            self.down = params.get(f"{p}experts.down_proj")  # [E, C, I]
            self.shared_down = params.get(f"{p}shared_expert.down_proj.weight")  # [C, Is]
            self.shared_expert_gate = params.get(f"{p}shared_expert_gate.weight")  # [1, C]

    @staticmethod
    def _with_shared(params: Params, name: str, shape: tuple[int, ...], shared: Tensor) -> Tensor:
        """``[E + 1, ...]``: the E routed experts of ``name`` (written in place), then the shared expert."""
        out = torch.empty((shape[0] + 1, *shape[1:]), dtype=params.dtype, device=params.device)
        params.into(name, out[:-1])
        out[-1].copy_(shared.detach())
        return out

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[N, C]`` after post_attention_layernorm. Returns ``[N, C]`` in x's dtype."""
        return self.forward_unfused(x) if self.quantized else moe_sublayer(self, x)

    def forward_unfused(self, x: Tensor) -> Tensor:
        """The module docstring's form: route, the routed experts, the shared expert beside them."""
        expert_ids, weights = route(x, self.w_router, self.top_k)  # [N, k] int64, [N, k] fp32
        if self.quantized:
            routed = self.experts(x, expert_ids, weights)  # [N, C] fp32
        else:
            routed = moe_experts(x, expert_ids, weights, self.gate_up, self.down)  # [N, C] fp32
        mlp = linear(swiglu_linear(x, self.shared_gate_up), self.shared_down)
        shared = torch.sigmoid(x @ self.shared_expert_gate.T) * mlp
        return (routed + shared.float()).to(x.dtype)

    def forward_grouped_with_shared(self, x: Tensor) -> Tensor:
        """:meth:`forward` of a prefill chunk whose routed pairs take the grouped GEMM anyway (more than
        ``MAX_TRITON_PAIRS``): the shared expert rides in it as pair k+1 (expert E, weight sigmoid(w_sg . x), the
        router's GEMM form past ``GEMM_ROWS`` rows), so the sublayer is the router's launches and the grouped GEMM's,
        not those plus about nine for the shared expert beside them (two GEMMs, the activation, the gate's GEMM
        and sigmoid, the gating product, two casts, the sum): a prefill step is bound by its host's launches
        (bench/results/2026-12-07e-h100-serve-prefill/). Needs
        ``shared_as_expert``; the fp32 sum of the k+1 pairs is rounded once to x's dtype."""
        expert_ids, weights = route(x, self.router_with_shared, self.top_k, shared_gate=True)  # [N, k+1]
        return moe_grouped.moe_experts_grouped(x, expert_ids, weights, self.gate_up_with_shared, self.down_with_shared,
                                               out_dtype=x.dtype)

    def forward_four_kernels(self, x: Tensor) -> Tensor:
        """:meth:`forward` by the router and routed-expert kernels, the shared expert as pair k+1
        (needs ``shared_as_expert``; the tests call it on the CPU under Triton's interpreter)."""
        expert_ids, weights = route_triton(x, self.router_with_shared, self.top_k, shared_gate=True)  # [N, k+1]
        return moe_experts_triton(x, expert_ids, weights, self.gate_up_with_shared, self.down_with_shared,
                                  ready=self.ready, out_dtype=x.dtype)


def _grouped_chunk(layer: FastMoE, x: Tensor) -> bool:
    """Rows whose routed pairs alone pass ``MAX_TRITON_PAIRS`` (a prefill chunk; a decode or verify step only past
    1,024 pairs: 16 requests x 8 verify rows x 8 experts keep their kernels), with the shared expert stored as
    expert E. The same rule eager and captured: the sublayer's forms honour ``fits`` inside a capture."""
    return layer.shared_as_expert and x.shape[0] * layer.top_k > moe_kernels.MAX_TRITON_PAIRS


# the whole sublayer where the shared expert is stored as expert E: the four-kernel form (class docstring) for up
# to SHARED_PAIR_ROWS rows, the grouped GEMM with the shared expert as pair k+1 for a prefill chunk past
# MAX_TRITON_PAIRS routed pairs; its twin is the unfused composition, whose ops dispatch on their own
moe_sublayer = KernelOp("moe_sublayer", FastMoE.forward_unfused,
                        GpuForm(FastMoE.forward_four_kernels,
                                fits=lambda layer, x: layer.shared_as_expert and x.shape[0] <= SHARED_PAIR_ROWS),
                        GpuForm(FastMoE.forward_grouped_with_shared, fits=_grouped_chunk))
