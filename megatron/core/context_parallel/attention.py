"""Core attention for long sequences: context parallelism (p2p / allgather / a2a / a2a+p2p) and packed
documents.

Called by DotProductAttention with Megatron's [s, b, n, d] tensors when the CP group has more than one
rank or the batch carries document boundaries (PackedSeqParams).
"""
import torch
import torch.nn.functional as F

from megatron.core.context_parallel.all_gather import AllGatherAttention
from megatron.core.context_parallel.all_to_all import seq_gather_head_scatter, seq_scatter_head_gather
from megatron.core.context_parallel.documents import document_attention
from megatron.core.context_parallel.kernels import cudnn_gqa_attention, cudnn_gqa_usable
from megatron.core.context_parallel.ring import RingAttention
from megatron.core.context_parallel.utils import CP_COMM_TYPES, document_layout


def _causal_attention(q, k, v, scale, layout):
    """Whole-sequence attention in [b, n, S, d]: plain causal SDPA, or per document."""
    if layout is not None:
        return document_attention(q, k, v, scale, layout)
    if (k.size(1) != q.size(1) and cudnn_gqa_usable(q, v) and torch.backends.cuda.cudnn_sdp_enabled()
            and not torch.are_deterministic_algorithms_enabled()):
        out = cudnn_gqa_attention(q, k, v, True, scale)  # K/V read at their own head count, not repeated
        if out is not None:
            return out
    if k.size(1) != q.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _scatter_heads(query, key, value, group):
    """All-to-all of q/k/v from a sequence split to a head split over ``group`` (K/V heads repeated per
    query head when there are too few to scatter)."""
    a2a = torch.distributed.get_world_size(group)
    n, g = query.size(2), key.size(2)
    if g % a2a:  # too few K/V heads to scatter: give each query head its own copy
        key, value = (t.repeat_interleave(n // g, dim=2) for t in (key, value))
    return [seq_gather_head_scatter(t, group) for t in (query, key, value)]


def _hierarchical(query, key, value, scale, groups, layout):
    """a2a+p2p: all-to-all over the inner group, the ring over the outer group, the inverse all-to-all.

    The inner group's ranks (consecutive CP ranks pA .. pA+A-1 of outer rank p) hold chunks pA+a and
    2CP-1-pA-a; gathered in the a2a order they form super-chunks p and 2P-1-p of A chunks each, which is
    exactly the load-balanced layout of a ring of P ranks, so the ring and its document masks run unchanged."""
    inner, outer = groups
    q, k, v = _scatter_heads(query, key, value, inner)  # [s_local * A, b, n / A, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n / A, s_local * A, d]
    out = RingAttention.apply(q, k, v, outer, scale, layout).permute(2, 0, 1, 3)
    return seq_scatter_head_gather(out, inner)  # [s_local, b, n, d]


def _cp_size(cp_group, cp_comm_type):
    if cp_group is None:
        return 1
    if cp_comm_type == "a2a+p2p":
        if not isinstance(cp_group, (list, tuple)) or len(cp_group) != 2:
            raise ValueError("--cp-comm-type a2a+p2p needs two context-parallel groups [a2a (inner), p2p (outer)]; "
                             "pass --hierarchical-context-parallel-sizes A P")
        return cp_group[0].size() * cp_group[1].size()
    return torch.distributed.get_world_size(cp_group)


# A compiled TransformerLayer (--torch-compile) breaks its graph here: the ring's send/recv and the
# autograd Functions stay eager, FlexAttention compiles itself.
@torch.compiler.disable
def long_context_attention(query, key, value, scale, cp_group=None, cp_comm_type="p2p", packed_seq_params=None):
    """[s_local, b, n, d] queries, [s_local, b, g, d] keys/values -> [s_local, b, n, d].

    ``cp_group`` None or of size 1: no context parallelism (documents only). For ``a2a+p2p`` it is the
    pair [inner a2a group, outer p2p group] (Transformer Engine's convention), CP = their sizes' product."""
    cp = _cp_size(cp_group, cp_comm_type)
    s, b = query.shape[:2]
    layout = None if packed_seq_params is None else document_layout(packed_seq_params, b, s * cp)
    if cp > 1 and cp_comm_type == "a2a+p2p":
        return _hierarchical(query, key, value, scale, cp_group, layout)
    if cp == 1 or cp_comm_type == "a2a":
        if cp > 1:
            query, key, value = _scatter_heads(query, key, value, cp_group)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, S, d]
        out = _causal_attention(q, k, v, scale, layout).permute(2, 0, 1, 3)  # [S, b, n, d]
        return seq_scatter_head_gather(out, cp_group) if cp > 1 else out
    if cp_comm_type not in ("p2p", "allgather"):
        raise ValueError(f"--cp-comm-type '{cp_comm_type}' unknown; use one of {', '.join(CP_COMM_TYPES)}")
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s_local, d]
    fn = RingAttention if cp_comm_type == "p2p" else AllGatherAttention
    out = fn.apply(q, k, v, cp_group, scale, layout)
    return out.permute(2, 0, 1, 3)  # [s_local, b, n, d]
