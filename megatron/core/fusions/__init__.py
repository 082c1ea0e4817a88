"""Optional fused / compiled kernels. Each has an eager fallback that computes the same function, so the
CPU path and tests never need a GPU compiler; the fast version is chosen on CUDA or by a flag."""
