"""The Triton kernels behind ``fusions.swiglu`` (imported only on CUDA).

Forward: ``out[n, f] = silu(h[n, f]) * h[n, F + f] (* p[n])``; backward: the two input-gradient halves and,
with probs, ``dp[n] = sum_f dout[n, f] * silu(h[n, f]) * h[n, F + f]``. All math in fp32, one rounding to
the output dtype. The backward program owns whole rows (a loop over the columns), so the row sum needs no
atomics and is deterministic.
"""
import triton
import triton.language as tl

_FWD_BLOCK_N, _FWD_BLOCK_F = 16, 256
_BWD_BLOCK_N, _BWD_BLOCK_F = 8, 256


@triton.jit
def _swiglu_fwd_kernel(h_ptr, p_ptr, out_ptr, n_rows, F, HAS_PROBS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    gate_off = rows64[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(h_ptr + gate_off, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + gate_off + F, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        out = out * p[:, None]
    tl.store(out_ptr + rows64[:, None] * F + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, p_ptr, dout_ptr, dh_ptr, dp_ptr, n_rows, F, HAS_PROBS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    p = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    dp = tl.zeros([BLOCK_N], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_mask[:, None] & (cols < F)[None, :]
        gate_off = rows64[:, None] * (2 * F) + cols[None, :]
        gate = tl.load(h_ptr + gate_off, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + gate_off + F, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + rows64[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        if HAS_PROBS:
            dp += tl.sum(dout * silu * up, axis=1)
            dout = dout * p[:, None]
        dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
        dup = dout * silu
        tl.store(dh_ptr + gate_off, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + gate_off + F, dup.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(dp_ptr + rows, dp.to(dp_ptr.dtype.element_ty), mask=row_mask)


def swiglu_forward(h, probs, out):
    """h [n, 2F] contiguous, probs [n] or None, out [n, F] (written)."""
    n, F = out.shape
    if n == 0:
        return
    grid = (triton.cdiv(n, _FWD_BLOCK_N), triton.cdiv(F, _FWD_BLOCK_F))
    _swiglu_fwd_kernel[grid](h, h if probs is None else probs, out, n, F, HAS_PROBS=probs is not None,
                             BLOCK_N=_FWD_BLOCK_N, BLOCK_F=_FWD_BLOCK_F, num_warps=4)


def swiglu_backward(h, probs, dout, dh, dprobs):
    """Writes dh [n, 2F] and, with probs, dprobs [n]; all contiguous."""
    n, F = dout.shape
    if n == 0:
        return
    has_probs = probs is not None
    grid = (triton.cdiv(n, _BWD_BLOCK_N),)
    _swiglu_bwd_kernel[grid](h, probs if has_probs else h, dout, dh, dprobs if has_probs else dh, n, F,
                             HAS_PROBS=has_probs, BLOCK_N=_BWD_BLOCK_N, BLOCK_F=_BWD_BLOCK_F, num_warps=4)
