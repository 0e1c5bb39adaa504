"""Triton kernels, each beside its reference twin (see conformance/ops/ and fast/kernels/common/registry.py)."""
