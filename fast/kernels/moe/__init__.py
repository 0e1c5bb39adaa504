"""MoE kernels: the router (softmax, top-k, renormalise) and the routed experts, sync-free and capturable."""
