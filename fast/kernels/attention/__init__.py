"""Kernels of gated full attention: the paged split-KV attention, the q/k norm + RoPE prologues, the output gate, and the RoPE helpers their torch twins share."""
