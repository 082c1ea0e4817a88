"""The Triton kernel behind ``grouped_wgrad.grouped_wgrad_into_main_grad`` (imported only where Triton builds kernels).

C[e] (+)= G_e^T X_e for the row blocks of G [R, M] and X [R, N] that ``offs`` (int32 cumulative row ends, one
per expert) cuts, C [E, M, N] in fp32: the experts' weight gradients accumulated in the GEMM's epilogue. One
program per (M tile, N tile, expert); the tiles of one expert are launched together so its G and X rows stay
in L2 while they are read once per tile.
"""
import os

import triton
import triton.language as tl


@triton.jit
def _tile(g_ptr, x_ptr, k, end, rm, rn, rk, M, N, stride_gr, stride_xr, IEEE: tl.constexpr):
    """G[k:k+BLOCK_K, rm]^T @ X[k:k+BLOCK_K, rn] over the rows below ``end`` (fp32)."""
    rows = k + rk
    in_rows = rows[:, None] < end
    a = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_gr + rm[None, :], mask=in_rows & (rm[None, :] < M),
                other=0.0)  # [BLOCK_K, BLOCK_M]
    b = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + rn[None, :], mask=in_rows & (rn[None, :] < N),
                other=0.0)  # [BLOCK_K, BLOCK_N]
    if IEEE:
        return tl.dot(tl.trans(a), b, input_precision="ieee")
    return tl.dot(tl.trans(a), b)


@triton.jit
def _grouped_wgrad_kernel(g_ptr, x_ptr, c_ptr, offs_ptr, M, N, stride_gr, stride_xr, stride_ce, stride_cm,
                          ACCUMULATE: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.program_id(2)
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
    end = tl.load(offs_ptr + e)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:  # Triton's CPU interpreter (tests) cannot take a loaded value as a range bound
        k = start
        while k < end:
            acc += _tile(g_ptr, x_ptr, k, end, rm, rn, rk, M, N, stride_gr, stride_xr, IEEE)
            k += BLOCK_K
    else:  # a for loop, which the compiler software-pipelines (the loads of the next rows under the dot)
        for k in range(start, end, BLOCK_K):
            acc += _tile(g_ptr, x_ptr, k, end, rm, rn, rk, M, N, stride_gr, stride_xr, IEEE)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, acc, mask=mask)


# Tile configurations the first call per shape times (grouped_wgrad.py keeps the fastest): (BLOCK_M, BLOCK_N,
# BLOCK_K, warps, stages). Square 128 tiles for the wide experts; a wider N tile for long rows (DeepSeek's 7168);
# a smaller tile with deeper pipelining for the short row blocks of many small experts (Qwen3's 128 x 768).
CONFIGS = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4))


def grouped_wgrad(out, grad, x, offs, accumulate: bool, block_m: int = 128, block_n: int = 128, block_k: int = 64,
                  num_warps: int = 8, num_stages: int = 3):
    """``out[e] (+)= grad[rows of e]^T @ x[rows of e]``; ``out`` [E, M, N] fp32 contiguous, ``grad`` [R, M] and
    ``x`` [R, N] contiguous rows, ``offs`` [E] int32 cumulative row ends."""
    experts, m, n = out.shape
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), experts)
    _grouped_wgrad_kernel[grid](grad, x, out, offs, m, n, grad.stride(0), x.stride(0), out.stride(0), out.stride(1),
                                ACCUMULATE=accumulate, IEEE=grad.dtype == out.dtype,
                                INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", BLOCK_M=block_m,
                                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out
