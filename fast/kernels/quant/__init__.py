"""GGUF-quantized weights kept as their file bytes on the device, and the kernels that compute with them.

- ``layout.py``: :class:`QuantWeight` (the bytes ``[rows, row_bytes]`` or stacked ``[E, rows, row_bytes]``, the
  type, the logical shape) and the block sizes;
- ``tables.py``: the IQ types' lookup tables, gguf-py's own;
- ``dequant_torch.py``: dequantization in torch (each block layout written out), bit for bit gguf-py's numpy;
- ``dequant_triton.py``: the Triton block decoders and the dequantize kernel (prefill: dequantize, then a GEMM);
- ``quant_matmul.py``: the fused dequant-matmul of a few rows (decode, verify), twin dequantize + matmul, and
  its routed-experts form (each row against its own expert of a stacked weight: the decode MoE's two products);
- ``quant_linear.py``: the entry points, :func:`dequantize` and :func:`quant_linear` (fused, fused in slices,
  or dequantize + GEMM, by row count);
- ``random_blocks.py``: random blocks drawn on the device (``--load-format dummy --dummy-weight-type``).

Types: Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS (F32, F16 and BF16 are views). Conformance:
conformance/ops/test_quant_dequant.py, conformance/ops/test_quant_linear.py.
"""

