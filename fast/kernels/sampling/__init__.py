"""Sampling kernels: keyed Philox uniforms, the sort-free top-k/top-p row filter, draws from the target distribution, and the verify (greedy prefix match and sparse-q rejection)."""
