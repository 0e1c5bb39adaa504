"""The routed experts of a GGUF MoE target, kept as their blocks (``fast/kernels/quant``).

    routed[n] = sum_j w[n, j] W_down[e_nj] swiglu(W_gate_up[e_nj] x[n])     (fp32 sum, as moe_experts)

Two forms, by the number of (row, choice) pairs P = N k:

- P <= ``PAIR_ROWS`` (decode and verify steps): each pair's row against its own expert's bytes,
  ``quant_matmul_experts`` twice (gate|up, then down), reading only the chosen experts' blocks (on CUDA
  the fused kernel: no dequantized copy, capturable);
- more (prefill chunks), or where one of the two is stored dense (a type the kernels do not decode, or a
  width llama.cpp could not quantize, which it stores as F16): every quantized expert dequantized to the model dtype for this call, then the dense routed
  experts op (``moe_experts``: on CUDA the grouped GEMM). The copy is a transient of the forward, which
  the memory plan's profiling forward at the largest chunk measures with the rest.

PAIR_ROWS is where a pair stops paying for reading its own expert: each pair streams a whole expert
(gate|up and down) while the dequantized form streams all E experts once and writes them; unmeasured,
its default is E (the pairs read at most the bytes of every expert once).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.dense.swiglu import swiglu_act
from ..kernels.moe.moe import moe_experts
from ..kernels.quant.quant_linear import dequantize, dequantize_op
from ..kernels.quant.quant_matmul import quant_matmul_experts
from ..kernels.quant.layout import QuantWeight
from ..weights.gguf_quantized import QuantParam


class QuantizedExperts:
    """``gate_up`` ``[E, 2I, C]`` and ``down`` ``[E, C, I]`` on the model's device: :class:`QuantParam` (at least
    one of them) or dense tensors in the model dtype."""

    ops = (quant_matmul_experts, dequantize_op, swiglu_act, moe_experts)

    def __init__(self, gate_up: QuantParam | Tensor, down: QuantParam | Tensor, dtype: torch.dtype):
        for name, w in (("gate_up", gate_up), ("down", down)):
            if isinstance(w, QuantParam) and (w.weight.num_experts is None or w.input_perm is not None):
                raise ValueError(f"QuantizedExperts {name}: expected stacked [E, R, K] GGUF blocks in the file's order")
        self.gate_up = gate_up.weight if isinstance(gate_up, QuantParam) else gate_up
        self.down = down.weight if isinstance(down, QuantParam) else down
        self.dtype = dtype
        both = isinstance(gate_up, QuantParam) and isinstance(down, QuantParam)
        self.pair_rows = gate_up.shape[0] if both else 0

    def __call__(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """x ``[N, C]``, expert_ids ``[N, k]``, weights ``[N, k]`` fp32 -> ``[N, C]`` fp32."""
        n, k = expert_ids.shape
        if n * k > self.pair_rows:
            return moe_experts(x, expert_ids, weights, _dense(self.gate_up, x.dtype), _dense(self.down, x.dtype))
        ids = expert_ids.reshape(-1)
        pairs = x.repeat_interleave(k, dim=0)  # [P, C], pair p = (p // k, p % k)
        act = swiglu_act(quant_matmul_experts(pairs, self.gate_up, ids))  # [P, I]
        out = quant_matmul_experts(act, self.down, ids)  # [P, C]
        return (out.float().view(n, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def _dense(w: QuantWeight | Tensor, dtype: torch.dtype) -> Tensor:
    return w if isinstance(w, Tensor) else dequantize(w, dtype)
