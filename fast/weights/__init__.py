"""Weights the fast engine holds in a form of its own: a GGUF target's matrices kept as their blocks
(``gguf_quantized.py``: :class:`QuantParam`, the loader), and dummy weights drawn as such blocks
(``dummy_quantized.py``). Between ``kernels`` (whose quant layout they use) and ``model`` (whose ``Params`` and
``linear`` consume them)."""
