"""Head-scattered attention (``--cp-comm-type a2a``, DeepSpeed-Ulysses): an all-to-all trades the
sequence split for a head split, each rank attends the whole sequence with n/CP heads, and a second
all-to-all trades back. Exact by construction; the heads must divide by CP. ``a2a+p2p`` uses the same pair
over its inner group (attention.py)."""
import torch
import torch.distributed as dist

from megatron.core.context_parallel.utils import cp_gather_order


class _AllToAll(torch.autograd.Function):
    """All-to-all of equal dim-0 slices; its own inverse, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_gather_head_scatter(x, group):
    """[s_local, b, h, d] -> [S, b, h / CP, d], the sequence in natural order."""
    cp = dist.get_world_size(group)
    s, b, h, d = x.shape
    if h % cp:
        raise ValueError(f"--cp-comm-type a2a / a2a+p2p: {h} heads on this rank do not divide by the {cp} ranks "
                         "of the all-to-all group (--context-parallel-size, or the first "
                         "--hierarchical-context-parallel-sizes value)")
    parts = x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp(head block), s, b, h/cp, d]
    full = _AllToAll.apply(parts, group).reshape(cp * s, b, h // cp, d)  # rank order of the sequence
    return full.index_select(0, torch.argsort(cp_gather_order(cp * s, cp, x.device)))


def seq_scatter_head_gather(y, group):
    """Inverse of ``seq_gather_head_scatter``: [S, b, h / CP, d] -> [s_local, b, h, d]."""
    cp = dist.get_world_size(group)
    seq, b, hc, d = y.shape
    ranked = y.index_select(0, cp_gather_order(seq, cp, y.device)).reshape(cp, seq // cp, b, hc, d)
    back = _AllToAll.apply(ranked, group)  # [cp(head block), s_local, b, h/cp, d]
    return back.permute(1, 2, 0, 3, 4).reshape(seq // cp, b, cp * hc, d)
