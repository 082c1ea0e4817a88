"""The Triton kernels behind ``moe_permute`` (imported only where Triton builds kernels).

Rows are grouped expert-major, token order within an expert (the order of the eager sort-based permutation). A
token's k destinations come from the running count of each expert's tokens (an inclusive scan of the transposed
map): row = offset[e] + (tokens before it routed to e). One program per token and block of the hidden size finds
the token's k experts in its map row, writes its row block to all k destinations (read once), and (the first
block's program) records them in ``token_rows`` [T, k] (expert order) for the way back: the unpermutation and both
backwards gather or scatter a token's k rows, summing in fp32 in that fixed order (deterministic, no atomics).
"""
import triton
import triton.language as tl


@triton.jit
def _destinations(map_ptr, cum_ptr, offs_ptr, t, T, E, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """Token t's destinations and experts, [K_PAD] each, in expert order (slots past k are 0). ``cum`` is the
    running count per expert, [E, T] (each expert's scan is contiguous, where torch's scan is fast)."""
    e = tl.arange(0, E_PAD)
    in_e = e < E
    routed = tl.load(map_ptr + t.to(tl.int64) * E + e, mask=in_e, other=0) != 0
    running = tl.load(cum_ptr + e.to(tl.int64) * T + t, mask=in_e, other=0)
    dest = tl.load(offs_ptr + e, mask=in_e, other=0) + running - 1
    slot = tl.cumsum(routed.to(tl.int32), axis=0) - 1
    j = tl.arange(0, K_PAD)
    pick = (slot[None, :] == j[:, None]) & routed[None, :]  # [K_PAD, E_PAD]: slot j holds expert e
    return tl.sum(tl.where(pick, dest[None, :], 0), axis=1), tl.sum(tl.where(pick, e[None, :], 0), axis=1), pick


@triton.jit
def _permute_kernel(x_ptr, map_ptr, cum_ptr, offs_ptr, probs_ptr, out_ptr, out_probs_ptr, sorted_ptr, rows_ptr,
                    experts_ptr, T, E, H, K: tl.constexpr, HAS_PROBS: tl.constexpr, E_PAD: tl.constexpr,
                    K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dest, expert, pick = _destinations(map_ptr, cum_ptr, offs_ptr, t, T, E, E_PAD, K_PAD)
    j = tl.arange(0, K_PAD)
    in_k = j < K
    if tl.program_id(1) == 0:  # the token's map and probabilities, once
        tl.store(rows_ptr + t * K + j, dest, mask=in_k)
        tl.store(experts_ptr + t * K + j, expert, mask=in_k)
        tl.store(sorted_ptr + dest, tl.broadcast_to(t.to(tl.int64), (K_PAD,)), mask=in_k)
        if HAS_PROBS:
            e = tl.arange(0, E_PAD)
            p = tl.load(probs_ptr + t.to(tl.int64) * E + e, mask=e < E, other=0.0)
            tl.store(out_probs_ptr + dest, tl.sum(tl.where(pick, p[None, :], 0.0), axis=1), mask=in_k)
    in_h = h < H
    row = tl.load(x_ptr + t.to(tl.int64) * H + h, mask=in_h, other=0.0)
    tl.store(out_ptr + dest.to(tl.int64)[:, None] * H + h[None, :], tl.broadcast_to(row[None, :], (K_PAD, BLOCK_H)),
             mask=in_k[:, None] & in_h[None, :])


@triton.jit
def _token_rows(rows_ptr, probs_ptr, t, K: tl.constexpr, HAS_PROBS: tl.constexpr, K_PAD: tl.constexpr):
    """Token t's k rows (``token_rows``), their mask over K_PAD slots, and with probs the rows' probabilities in
    fp32 (else ones)."""
    j = tl.arange(0, K_PAD)
    in_k = j < K
    dest = tl.load(rows_ptr + t * K + j, mask=in_k, other=0)
    if HAS_PROBS:
        p = tl.load(probs_ptr + dest, mask=in_k, other=0.0).to(tl.float32)
    else:
        p = tl.full([K_PAD], 1.0, tl.float32)
    return dest, in_k, p


@triton.jit
def _gather_sum_kernel(y_ptr, rows_ptr, probs_ptr, out_ptr, H, K: tl.constexpr, HAS_PROBS: tl.constexpr,
                       K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_j y[rows[t, j]] (x probs[rows[t, j]]), fp32 accumulation: the unpermutation, and the
    permutation's backward (without probs)."""
    t = tl.program_id(0)
    dest, in_k, p = _token_rows(rows_ptr, probs_ptr, t, K, HAS_PROBS, K_PAD)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = h < H
    rows = tl.load(y_ptr + dest.to(tl.int64)[:, None] * H + h[None, :], mask=in_k[:, None] & in_h[None, :],
                   other=0.0).to(tl.float32)
    if HAS_PROBS:
        rows = rows * p[:, None]
    tl.store(out_ptr + t.to(tl.int64) * H + h, tl.sum(rows, axis=0).to(out_ptr.dtype.element_ty), mask=in_h)


@triton.jit
def _scatter_kernel(g_ptr, rows_ptr, probs_ptr, y_ptr, dy_ptr, dprobs_ptr, H, K: tl.constexpr,
                    HAS_PROBS: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """The unpermutation's backward: dy[rows[t, j]] = g[t] (x probs[rows[t, j]]), and with probs their gradient,
    dprobs[rows[t, j]] = <y[rows[t, j]], g[t]> (fp32). One program walks the whole row (the dot product needs it),
    where the two kernels above take a block of it each."""
    t = tl.program_id(0)
    dest, in_k, p = _token_rows(rows_ptr, probs_ptr, t, K, HAS_PROBS, K_PAD)
    if HAS_PROBS:
        dot = tl.zeros([K_PAD], tl.float32)
    rows = dest.to(tl.int64)[:, None] * H
    src = g_ptr + t.to(tl.int64) * H
    h0 = 0
    while h0 < H:  # (Triton's CPU interpreter, which the tests run, cannot take a `range` over an argument)
        h = h0 + tl.arange(0, BLOCK_H)
        h0 += BLOCK_H
        in_h = h < H
        mask = in_k[:, None] & in_h[None, :]
        g = tl.load(src + h, mask=in_h, other=0.0).to(tl.float32)
        grad = tl.broadcast_to(g[None, :], (K_PAD, BLOCK_H))
        if HAS_PROBS:
            y = tl.load(y_ptr + rows + h[None, :], mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(y * g[None, :], axis=1)
            grad = grad * p[:, None]
        tl.store(dy_ptr + rows + h[None, :], grad.to(dy_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(dprobs_ptr + dest, dot.to(dprobs_ptr.dtype.element_ty), mask=in_k)


def _launch_args(hidden: int, k: int):
    block_h = min(triton.next_power_of_2(hidden), max(64, 4096 // triton.next_power_of_2(k)))
    return dict(K=k, K_PAD=triton.next_power_of_2(k), BLOCK_H=block_h, num_warps=4)


def permute(x, routing_map, cum, offs, probs, out, out_probs, sorted_indices, token_rows, token_experts):
    """Write every token's row (and prob) to its k destinations; fill sorted_indices [N] (int64), token_rows and
    token_experts [T, k] (int32). ``cum``: [E, T] int32, each expert's running count of its tokens."""
    tokens, experts = routing_map.shape
    k = token_rows.shape[1]
    launch = _launch_args(x.shape[1], k)
    _permute_kernel[(tokens, triton.cdiv(x.shape[1], launch["BLOCK_H"]))](
        x, routing_map, cum, offs, probs if probs is not None else x, out, out_probs if out_probs is not None else out,
        sorted_indices, token_rows, token_experts, tokens, experts, x.shape[1], HAS_PROBS=probs is not None,
        E_PAD=triton.next_power_of_2(experts), **launch)


def gather_sum(y, token_rows, probs, out):
    """out[t] = sum over token t's rows of y (times probs), fp32 accumulation."""
    launch = _launch_args(y.shape[1], token_rows.shape[1])
    _gather_sum_kernel[(token_rows.shape[0], triton.cdiv(y.shape[1], launch["BLOCK_H"]))](
        y, token_rows, probs if probs is not None else y, out, y.shape[1], HAS_PROBS=probs is not None, **launch)


def scatter(g, token_rows, probs, y, dy, dprobs):
    """dy's rows from g's (times probs), and with probs their gradient into dprobs [N]."""
    _scatter_kernel[(token_rows.shape[0],)](g, token_rows, probs if probs is not None else g, y, dy,
                                            dprobs if dprobs is not None else dy, g.shape[1],
                                            HAS_PROBS=probs is not None,
                                            **_launch_args(g.shape[1], token_rows.shape[1]))
