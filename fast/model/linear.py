"""The projections of the fast models, dense or GGUF-quantized: ``linear(x, w) = x @ W^T``.

A module holds each projection weight as what :class:`Params` gave it:

- a dense ``Tensor`` ``[R, K]`` in the model dtype: ``x @ w.T`` through ``fast/kernels/dense/skinny_linear``'s
  op: its Triton kernel where that GPU's sweep measured it faster than cuBLAS at the shape and row count
  (``skinny_linear.TUNED``), cuBLAS otherwise;
- a :class:`QuantParam` (a GGUF matrix kept as its blocks, ``fast/weights/gguf_quantized.py``):
  ``quant_linear`` (``fast/kernels/quant``: the fused dequant-matmul for decode and verify rows, dequantize
  then a dense GEMM for prefill chunks), its input first put in the file's column order where the converter
  permuted columns (``input_perm``);
- a ``tuple`` of those, for projections :meth:`Params.fused` could not fuse (quantized parts of different
  types, as llama.cpp's mixtures store ``attn_v`` apart from ``attn_q``/``attn_k``): each part's product,
  concatenated on the output dimension, the order of the parts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.dense.skinny_linear import has_tuned_config, skinny_linear
from ..kernels.dense.swiglu import swiglu_act
from ..kernels.quant.quant_linear import quant_linear
from ..weights.gguf_quantized import QuantParam

Weight = Tensor | QuantParam | tuple


def linear(x: Tensor, w: Weight) -> Tensor:
    """``x @ W^T``: x ``[N, K]``, W ``[R, K]`` (logical) -> ``[N, R]`` in x's dtype."""
    if isinstance(w, Tensor):
        return skinny_linear(x, w) if x.dim() == 2 else x @ w.T
    if isinstance(w, QuantParam):
        if w.input_perm is not None:
            x = x.index_select(-1, w.input_perm)
        return quant_linear(x, w.weight)
    return torch.cat([linear(x, part) for part in w], dim=-1)


def swiglu_linear(x: Tensor, w: Weight) -> Tensor:
    """``silu(g) * u`` of ``[g | u] = x @ W^T``: x ``[N, K]``, W ``[2I, K]`` (gate rows, then up rows) -> ``[N, I]``.
    Where the skinny kernel is tuned for the dense shape, the SwiGLU is its GEMM's epilogue (g and u in fp32, no
    ``[N, 2I]`` round trip); else the GEMM, then ``swiglu_act`` (g and u rounded to x's dtype first: the two
    differ by that rounding, within NUMERIC)."""
    if isinstance(w, Tensor) and x.dim() == 2 and has_tuned_config(x, w, swiglu=True):
        return skinny_linear(x, w, swiglu=True)
    return swiglu_act(linear(x, w))


def out_features(w: Weight) -> int:
    """R, the rows of ``w`` (the sum of its parts' for a tuple)."""
    if isinstance(w, tuple):
        return sum(out_features(part) for part in w)
    return w.shape[-2]
