"""The DFlash 2 draft's kernels: its grouped dynamic conv (prepare, and finish + norm), the context K/V prologue, the ring attention and the candidate selector's walk."""
