"""Batched, token-major model forwards of the fast engine (target, MTP head, DFlash draft).

``batch`` the step contract (ForwardBatch); ``pools`` the caches (paged K/V, GDN slots, verify
scratch); ``step`` per-step metadata shared by every layer; ``capture`` the cut points of a CUDA-graph
capture; ``params`` shape-checked canonical weights; one module per layer concept twinned with the
reference (``attention``, ``gdn``, ``mlp``, ``moe``, ``layer``); ``target``, ``mtp`` and ``draft`` the
models. The compute ops they call (each a torch twin and its kernels) live in ``fast/kernels/``.
"""
