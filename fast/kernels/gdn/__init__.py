"""Gated DeltaNet kernels: the decode/verify prologue, the recurrence (Triton, and flash-linear-attention's chunked prefill), the ops over the state slots, and the verify commit."""
