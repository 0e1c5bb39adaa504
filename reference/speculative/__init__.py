"""Speculative decoding, readable: the target distribution p, proposers (DFlash 2, MTP, n-gram), the
DFlash ring and selector, the verifier (greedy and sparse-q rejection) and the one-request loop.
Twins: ``fast/speculative/`` and ``fast/kernels/`` (held to these by ``conformance/``)."""
