"""Speculative decoding in the fast engine: batched proposers (DFlash 2, MTP), the ring and window
pools. Twins: ``reference/speculative/``; the verify kernels live in ``fast/kernels/``."""
