"""Ring attention (``--cp-comm-type p2p``): K/V travel around the CP group while each rank attends its
local queries to the block it holds; the next block's send/recv runs while the current one computes.

With the load-balanced layout (rank r holds chunks r and 2CP-1-r), at ring step i the block from rank
src = r - i is: step 0, the local block (causal); src < r, both query chunks see src's first chunk
only; src > r, only the second query chunk sees both of src's chunks. Backward runs the ring again
with the K/V gradients travelling with their K/V, each rank adding its share, and one last hop home.
"""
import torch
import torch.distributed as dist

from megatron.core.context_parallel.kernels import BlockMask, block_backward, block_forward, merge


class _Ring:
    """Neighbours in the CP group and one overlapped exchange at a time."""

    def __init__(self, group):
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        self.size, self.rank = len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def start(self, send: torch.Tensor, tag: int):
        """Send ``send`` to the next rank, receive the same shape from the previous one (async)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs):
        for req in reqs:
            req.wait()


def _block_plan(step, ring, c, layout):
    """(query slice, key/value slice, BlockMask) of ring step ``step`` on this rank."""
    src = (ring.rank - step) % ring.size
    all_, first, second = slice(None), slice(0, c), slice(c, None)
    if step == 0:
        qs, ks, causal = all_, all_, True
    elif src < ring.rank:
        qs, ks, causal = all_, first, False
    else:
        qs, ks, causal = second, all_, False
    if layout is None:
        return qs, ks, BlockMask(causal=causal)
    q_doc, q_pos = layout.local(ring.size, ring.rank)
    k_doc, k_pos = layout.local(ring.size, src)
    return qs, ks, BlockMask(causal, q_doc[:, qs], k_doc[:, ks], q_pos[qs], k_pos[ks])


class RingAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v over the whole sequence, queries local, keys and values ringed.
    q: [b, n, s_local, d]; k, v: [b, g, s_local, d]; ``layout``: DocumentLayout or None (causal)."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, layout):
        ring = _Ring(group)
        c = q.size(2) // 2
        kv = torch.stack([k, v]).contiguous()  # [2, b, g, s_local, d]: one message per step
        out = lse = None
        for step in range(ring.size):
            reqs = None
            if step + 1 < ring.size:
                recv, reqs = ring.start(kv, tag=1)
            qs, ks, mask = _block_plan(step, ring, c, layout)
            o_b, l_b = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, mask)
            if out is None:
                out, lse = o_b, l_b
            else:
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o_b, l_b)
            if reqs is not None:
                ring.wait(reqs)
                kv = recv
        ctx.group, ctx.scale, ctx.layout = group, scale, layout
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        c = q.size(2) // 2
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv_done = None  # finished gradient of the previous step's K/V, to pass on
        for step in range(ring.size):
            reqs = []
            if step + 1 < ring.size:
                kv_next, r = ring.start(kv, tag=1)
                reqs += r
            if dkv_done is not None:
                dkv_in, r = ring.start(dkv_done, tag=2)  # partial sums for the K/V we hold now
                reqs += r
            qs, ks, mask = _block_plan(step, ring, c, ctx.layout)
            dq_b, dk_b, dv_b = block_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                              out[:, :, qs], lse[:, :, qs], ctx.scale, mask)
            dq[:, :, qs] += dq_b
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            dkv[0][:, :, ks] += dk_b
            dkv[1][:, :, ks] += dv_b
            ring.wait(reqs)
            if dkv_done is not None:
                dkv += dkv_in
            dkv_done = dkv
            if step + 1 < ring.size:
                kv = kv_next
        # The K/V now held came from rank + 1; its finished gradient goes home, ours arrives.
        dkv_home, reqs = ring.start(dkv_done, tag=2) if ring.size > 1 else (dkv_done, [])
        ring.wait(reqs)
        return dq.to(q.dtype), dkv_home[0].to(k.dtype), dkv_home[1].to(v.dtype), None, None, None
