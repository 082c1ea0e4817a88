"""All-gathered K/V (``--cp-comm-type allgather``): every rank gathers the whole sequence's keys and
values, then attends its two query chunks; K/V gradients are reduce-scattered back to their owners.

Query chunk j (global index) sees chunks 0..j-1 fully and chunk j causally: two blocks merged by LSE.
"""
import torch
import torch.distributed as dist

from megatron.core.context_parallel.kernels import BlockMask, block_backward, block_forward, merge
from megatron.core.context_parallel.utils import cp_chunk_ids, cp_gather_order


def _gather(t, group, cp):
    """[b, g, s_local, d] on each rank -> [b, g, S, d] in natural sequence order."""
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    full = torch.cat(parts, dim=2)  # rank order
    return full.index_select(2, torch.argsort(cp_gather_order(full.size(2), cp, t.device)))


def _reduce_scatter(grad, group, cp, rank):
    """Sum [b, g, S, d] over the group and keep this rank's local tokens."""
    order = cp_gather_order(grad.size(2), cp, grad.device)
    ranked = grad.index_select(2, order)  # rank order: rank r's tokens are the r-th slice
    parts = [p.contiguous() for p in ranked.chunk(cp, dim=2)]
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(parts[rank])
        dist.reduce_scatter(out, parts, group=group)
        return out
    dist.all_reduce(ranked, group=group)  # gloo has no reduce-scatter
    return ranked.chunk(cp, dim=2)[rank]


def _blocks(rank, cp, c, layout):
    """(query slice, key slice, BlockMask) pairs for this rank's two query chunks."""
    out = []
    for local, j in enumerate(cp_chunk_ids(cp, rank)):
        qs = slice(local * c, (local + 1) * c)
        for ks, causal in ((slice(0, j * c), False), (slice(j * c, (j + 1) * c), True)):
            if ks.stop == ks.start:
                continue
            if layout is None:
                out.append((qs, ks, BlockMask(causal=causal)))
                continue
            q_doc, q_pos = layout.local(cp, rank)
            k_pos = torch.arange(ks.start, ks.stop, device=q_pos.device)
            out.append((qs, ks, BlockMask(causal, q_doc[:, qs], layout.doc[:, ks], q_pos[qs], k_pos)))
    return out


class AllGatherAttention(torch.autograd.Function):
    """q: [b, n, s_local, d]; k, v: [b, g, s_local, d] -> [b, n, s_local, d]."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, layout):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        kf, vf = _gather(k, group, cp), _gather(v, group, cp)
        c = q.size(2) // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        for qs, ks, mask in _blocks(rank, cp, c, layout):
            o_b, l_b = block_forward(q[:, :, qs], kf[:, :, ks], vf[:, :, ks], scale, mask)
            out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o_b, l_b)
        ctx.group, ctx.scale, ctx.layout = group, scale, layout
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        kf, vf = _gather(k, group, cp), _gather(v, group, cp)  # recomputed: not kept between passes
        c = q.size(2) // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkf = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
        dvf = torch.zeros_like(dkf)
        for qs, ks, mask in _blocks(rank, cp, c, ctx.layout):
            dq_b, dk_b, dv_b = block_backward(dout[:, :, qs], q[:, :, qs], kf[:, :, ks], vf[:, :, ks],
                                              out[:, :, qs], lse[:, :, qs], ctx.scale, mask)
            dq[:, :, qs] += dq_b
            dkf[:, :, ks] += dk_b
            dvf[:, :, ks] += dv_b
        dk = _reduce_scatter(dkf, group, cp, rank)
        dv = _reduce_scatter(dvf, group, cp, rank)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
