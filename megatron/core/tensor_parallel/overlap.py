"""Sequence-parallel linears with their TP communication overlapped with the GEMMs (``--tp-comm-overlap``).

Our own implementation (no Transformer Engine userbuffers, no NVLink multicast). Under SP the
column-parallel linears (QKV, fc1) all-gather X along the sequence before their GEMM and the row-parallel
ones (proj, fc2) reduce-scatter Y after it. Here both are split into the TP ranks' sequence blocks and
pipelined: while one block's GEMM runs, another block travels. Two transports:
- on NCCL groups with symmetric memory (GPUs of one node), ``peer_copy``: the copy engines read the peers'
  blocks over NVLink, beside GEMMs that fill every SM;
- elsewhere (gloo, or where symmetric memory cannot be set up: said once), a ring of ``batch_isend_irecv``:
  block i+1 travels to the next rank while block i's GEMM runs; on a GPU its NCCL kernels need SMs and
  mostly wait for the GEMMs.
Backward of the column layer uses Megatron's bulk overlaps: the re-gather of X runs behind the dX GEMM
and the dX reduce-scatter behind the wgrad GEMM.

The math is that of the plain path: the same GEMM, row block by row block (the all-gather side gives
the same values), and for the reduce-scatter the same partial sums added in ring order.
"""
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import peer_copy
from megatron.core.tensor_parallel.mappings import _all_gather_single, _reduce_scatter_single
from megatron.core.tensor_parallel.weight_grad import weight_grad


def _ring(group):
    """(this rank's index in ``group``, group size, global rank of the next and of the previous rank)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    return r, n, ranks[(r + 1) % n], ranks[(r - 1) % n]


def _send_recv(send, recv, nxt, prev, group):
    """Post send -> next rank and recv <- previous rank; returns the works to wait on."""
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prev, group)]
    return dist.batch_isend_irecv(ops)


def _wait(works):
    for w in works:
        w.wait()


def _mm_into(a, mat, out):
    """out = a @ mat over the last dim, written in place (``out`` is a contiguous row block)."""
    torch.mm(a.reshape(-1, a.size(-1)), mat, out=out.view(-1, mat.size(-1)))


def ring_all_gather_mm(x, mat, group):
    """(all_gather(x) @ mat, all_gather(x)), gathered along dim 0 of ``x`` [m, ..., k] over ``group``.

    Step i multiplies the block of rank (r - i) while passing that same block on to rank r + 1 and
    receiving block (r - i - 1) from rank r - 1: n - 1 transfers, each hidden behind one block's GEMM."""
    r, n, nxt, prev = _ring(group)
    m = x.size(0)
    total = x.new_empty((n * m,) + tuple(x.shape[1:]))  # [n*m, ..., k]
    out = x.new_empty((n * m,) + tuple(x.shape[1:-1]) + (mat.size(-1),))  # [n*m, ..., mat_out]
    block = lambda t, c: t[c * m:(c + 1) * m]
    block(total, r).copy_(x)
    for i in range(n):
        c = (r - i) % n
        works = _send_recv(block(total, c), block(total, (c - 1) % n), nxt, prev, group) if i < n - 1 else []
        _mm_into(block(total, c), mat, block(out, c))
        _wait(works)
    return out, total


def ring_mm_reduce_scatter(x, mat, group):
    """reduce_scatter(x @ mat) along dim 0 over ``group``: x [n*m, ..., k] -> [m, ..., mat_out].

    Step i computes this rank's partial product for block (r - i - 1), adds the running sum received
    from rank r - 1 for that block and sends it on to rank r + 1; the GEMM of step i + 1 runs while it
    travels. The last step's block is rank r's own, now summed over all ranks."""
    r, n, nxt, prev = _ring(group)
    m = x.size(0) // n
    if m * n != x.size(0):
        raise ValueError(f"sequence length {x.size(0)} is not divisible by the TP size {n}")
    works, recv = [], None
    for i in range(n):
        c = (r - i - 1) % n
        part = x.new_empty((m,) + tuple(x.shape[1:-1]) + (mat.size(-1),))
        _mm_into(x[c * m:(c + 1) * m], mat, part)
        _wait(works)
        if recv is not None:
            part += recv
        if i < n - 1:
            recv = torch.empty_like(part)
            works = _send_recv(part, recv, nxt, prev, group)
    return part


def all_gather_mm(x, mat, group):
    """(all_gather(x) @ mat, all_gather(x)) along dim 0, the transfers pipelined with the GEMM."""
    done = peer_copy.all_gather_mm(x, mat, group)
    return done if done is not None else ring_all_gather_mm(x, mat, group)


def mm_reduce_scatter(x, mat, group):
    """reduce_scatter(x @ mat) along dim 0, the transfers pipelined with the GEMM."""
    done = peer_copy.mm_reduce_scatter(x, mat, group)
    return done if done is not None else ring_mm_reduce_scatter(x, mat, group)


def _gather_start(x, group, async_op):
    """(total, wait): all_gather(x) along dim 0, running until ``wait()`` where ``async_op``."""
    if async_op:
        started = peer_copy.all_gather_start(x, group)
        if started is not None:
            return started
    total, work = _gather(x, group, async_op)
    return total, (work.wait if work is not None else lambda: None)


def _mm_reduce_scatter_start(x, mat, group, async_op):
    """finish() -> reduce_scatter(x @ mat) along dim 0, running until then where ``async_op``. On the copy
    engines the GEMM is issued block by block, the peers' blocks straight into the transfer slot."""
    if async_op:
        finish = peer_copy.mm_reduce_scatter_start(x, mat, group)
        if finish is not None:
            return finish
    return _reduce_scatter_start(x.matmul(mat), group, async_op)


def _reduce_scatter_start(x, group, async_op):
    """finish() -> reduce_scatter(x) along dim 0, running until then where ``async_op``."""
    if async_op:
        finish = peer_copy.reduce_scatter_start(x, group)
        if finish is not None:
            return finish
    out, work = _reduce_scatter(x, group, async_op)

    def finish_nccl():
        if work is not None:
            work.wait()
        return out
    return finish_nccl


def _gather(x, group, async_op):
    total = x.new_empty((dist.get_world_size(group) * x.size(0),) + tuple(x.shape[1:]))
    work = _all_gather_single(total, x.contiguous(), group=group, async_op=async_op)
    return total, work


def _reduce_scatter(x, group, async_op):
    out = x.new_empty((x.size(0) // dist.get_world_size(group),) + tuple(x.shape[1:]))
    work = _reduce_scatter_single(out, x.contiguous(), group=group, async_op=async_op)
    return out, work


def _weight_grad(weight, fusion, g, x):
    return weight_grad(weight, fusion, g.reshape(-1, g.size(-1)), x.reshape(-1, x.size(-1)))


class ColumnParallelLinearWithOverlap(torch.autograd.Function):
    """Y = all_gather(X) W^T + b for a column-parallel linear under SP (X: [s/tp, b, h]).

    Forward: the all-gather is a ring pipelined with the GEMM (``overlap_ag``). Backward: the re-gather
    of X runs behind the dX GEMM (``bulk_dgrad``), the dX reduce-scatter behind the wgrad GEMM
    (``bulk_wgrad``). Only the local X chunk is saved, as in the plain path."""

    @staticmethod
    def forward(ctx, x, weight, bias, fusion, group, overlap_ag, bulk_dgrad, bulk_wgrad):
        ctx.save_for_backward(x, weight)
        ctx.use_bias, ctx.fusion, ctx.group = bias is not None, fusion, group
        ctx.bulk_dgrad, ctx.bulk_wgrad = bulk_dgrad, bulk_wgrad
        if overlap_ag:
            out, _ = all_gather_mm(x, weight.t(), group)  # [s, b, out/tp]
        else:
            out = torch.matmul(_gather(x, group, False)[0], weight.t())
        return out.add_(bias) if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        total_x, gathered = _gather_start(x, ctx.group, ctx.bulk_dgrad)  # [s, b, h], during the dX GEMM
        finish_rs = _mm_reduce_scatter_start(grad_output, weight, ctx.group, ctx.bulk_wgrad)  # [s/tp, b, h]
        gathered()
        grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(dim=0) if ctx.use_bias else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # runs while dX is reduce-scattered
            grad_weight = _weight_grad(weight, ctx.fusion, grad_output, total_x)
        return finish_rs(), grad_weight, grad_bias, None, None, None, None, None


class RowParallelLinearWithOverlap(torch.autograd.Function):
    """reduce_scatter(X W^T) along the sequence for a row-parallel linear under SP (X: [s, b, h/tp]).

    Forward: the GEMM and the reduce-scatter are a ring (``overlap_rs``). Backward: the all-gather of
    dY is a ring pipelined with the dX GEMM (``overlap_ag``); the wgrad GEMM uses the gathered dY."""

    @staticmethod
    def forward(ctx, x, weight, fusion, group, overlap_rs, overlap_ag):
        ctx.save_for_backward(x, weight)
        ctx.fusion, ctx.group, ctx.overlap_ag = fusion, group, overlap_ag
        if overlap_rs:
            return mm_reduce_scatter(x, weight.t(), group)  # [s/tp, b, h]
        return _reduce_scatter(torch.matmul(x, weight.t()), group, False)[0]

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        if ctx.overlap_ag:
            grad_input, total_grad = all_gather_mm(grad_output, weight, ctx.group)
        else:
            total_grad = _gather(grad_output, ctx.group, False)[0]  # [s, b, h]
            grad_input = total_grad.matmul(weight)
        grad_weight = _weight_grad(weight, ctx.fusion, total_grad, x) if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None, None, None, None


# Under --torch-compile the ring runs between a layer's compiled pieces: dynamo does not trace
# batch_isend_irecv, and a compiled graph would also fix the order of GEMMs and waits the ring relies on.
@torch.compiler.disable
def column_parallel_linear_with_overlap(x, weight, bias, fusion, group, overlap_ag, bulk_dgrad, bulk_wgrad):
    return ColumnParallelLinearWithOverlap.apply(x, weight, bias, fusion, group, overlap_ag, bulk_dgrad, bulk_wgrad)


@torch.compiler.disable
def row_parallel_linear_with_overlap(x, weight, fusion, group, overlap_rs, overlap_ag):
    return RowParallelLinearWithOverlap.apply(x, weight, fusion, group, overlap_rs, overlap_ag)
