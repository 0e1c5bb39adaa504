"""Dense-layer kernels: the fused residual add + RMSNorm and the gated RMSNorm, the SwiGLU activation, and the skinny GEMM of a few rows."""
