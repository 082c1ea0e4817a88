"""The Triton kernel behind ``fusions.rope`` (imported only where Triton builds kernels).

out = t * cos + rotate_half(t) * sin on the first ROT channels (cos and sin of ``freqs`` times ``mscale``), the
rest passed through. rotate_half pairs channel c with a partner p and a sign: p = c + ROT/2 with sign -1 in the
first half, c - ROT/2 with +1 in the second (the half-by-half layout); p = c ^ 1 with -1 on even channels, +1 on odd
ones (interleaved). The backward is the transposed map: dt_c = g_c cos_c - sign_c g_p sin_p. One program per
(position, batch) row and block of heads; cos and sin are computed in fp32 from the position's freqs.
"""
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, f_ptr, out_ptr, B, N, D, ROT, stride_xs, stride_xb, stride_xn, stride_fs, mscale,
                 BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):
    row = tl.program_id(0)
    s = row // B
    b = row % B
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, D_PAD)
    in_n = n < N
    in_d = c < D
    rot = c < ROT
    if INTERLEAVED:
        partner = c ^ 1
        sign = tl.where(c % 2 == 0, -1.0, 1.0)
    else:
        half = ROT // 2
        partner = tl.where(c < half, c + half, c - half)
        sign = tl.where(c < half, -1.0, 1.0)
    partner = tl.where(rot, partner, c)
    f_row = f_ptr + s.to(tl.int64) * stride_fs
    f = tl.load(f_row + c, mask=rot, other=0.0).to(tl.float32)
    cos = tl.cos(f) * mscale
    if BACKWARD:
        sin = tl.sin(tl.load(f_row + partner, mask=rot, other=0.0).to(tl.float32)) * mscale
    else:
        sin = tl.sin(f) * mscale
    x_row = x_ptr + s.to(tl.int64) * stride_xs + b.to(tl.int64) * stride_xb + n.to(tl.int64)[:, None] * stride_xn
    mask = in_n[:, None] & in_d[None, :]
    x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_row + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    if BACKWARD:
        y = x * cos[None, :] - (sign * sin)[None, :] * xp
    else:
        y = x * cos[None, :] + (sign * sin)[None, :] * xp
    y = tl.where(rot[None, :], y, x)
    out_row = out_ptr + (row.to(tl.int64) * N + n.to(tl.int64))[:, None] * D
    tl.store(out_row + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rope(x, freqs, out, mscale: float, interleaved: bool, backward: bool):
    """``out`` [s, b, n, d] contiguous from ``x`` [s, b, n, d] (last dim contiguous) and ``freqs`` [>= s, ..., rot]
    (last dim contiguous)."""
    s, b, n, d = x.shape
    d_pad = triton.next_power_of_2(d)
    block_n = max(1, min(triton.next_power_of_2(n), 4096 // d_pad))
    grid = (s * b, triton.cdiv(n, block_n))
    _rope_kernel[grid](x, freqs, out, b, n, d, freqs.shape[-1], x.stride(0), x.stride(1), x.stride(2), freqs.stride(0),
                       float(mscale), BACKWARD=backward, INTERLEAVED=interleaved, BLOCK_N=block_n, D_PAD=d_pad,
                       num_warps=4)
