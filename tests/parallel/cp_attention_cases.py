"""Context-parallel attention against one process attending the whole sequence (run by
test_context_parallel.py inside its world of 4 ranks).

For every comm type at CP=2 and CP=4 (a2a+p2p at each split of 2 and 4 ranks), with and without packed
documents, the local output and the gradients of the local q/k/v equal the matching slices of full causal
(or per-document) attention, the reference running SDPA on each document separately.
"""
import torch
import torch.nn.functional as F

S, B, N, G, D = 32, 2, 4, 2, 8


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, N, D, generator=g)
    k, v = torch.randn(S, B, G, D, generator=g), torch.randn(S, B, G, D, generator=g)
    dout = torch.randn(S, B, N, D, generator=g)
    return q, k, v, dout


def _cu_seqlens():
    """Documents of lengths 5, 11, 16 in sample 0 and 20, 12 in sample 1 (flattened THD offsets)."""
    return torch.tensor([0, 5, 16, 32, 52, 64], dtype=torch.int32)


def _reference(q, k, v, dout, docs):
    """Full attention per document with SDPA, [s, b, n, d] in and out; returns out and grads."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    outs = []
    bounds = [[0, 5, 16, 32], [0, 20, 32]] if docs else [[0, S], [0, S]]
    for b in range(B):
        pieces = []
        for lo, hi in zip(bounds[b][:-1], bounds[b][1:]):
            qq, kk, vv = (t[lo:hi, b].transpose(0, 1)[None] for t in (q, k, v))  # [1, n, s, d]
            kk, vv = kk.repeat_interleave(N // G, 1), vv.repeat_interleave(N // G, 1)
            pieces.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1))
        outs.append(torch.cat(pieces))
    out = torch.stack(outs, dim=1)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _hierarchical_groups(cp, sizes):
    """This rank's [a2a (inner), p2p (outer)] groups when consecutive blocks of ``cp`` ranks form CP groups."""
    from megatron.core.process_group_registry import create_hierarchical_groups
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = None
    for start in range(0, world, cp):  # every rank creates every group, in the same order
        ranks = list(range(start, start + cp))
        groups, _ = create_hierarchical_groups(rank, ranks, sizes)
        if rank in ranks:
            mine = groups
    return mine


def _cp_case(cp, comm, docs, sizes=None):
    from megatron.core.context_parallel import cp_local_indices, long_context_attention
    from megatron.core.packed_seq_params import PackedSeqParams
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if sizes is None:
        groups = [torch.distributed.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]
        group = groups[rank // cp]
    else:
        group = _hierarchical_groups(cp, sizes)
    cp_rank = rank % cp
    q, k, v, dout = _inputs()
    ref = _reference(q, k, v, dout, docs)
    idx = cp_local_indices(S, cp, cp_rank)
    ql, kl, vl = (t.index_select(0, idx).clone().requires_grad_() for t in (q, k, v))
    packed = PackedSeqParams(cu_seqlens_q=_cu_seqlens(), cu_seqlens_kv=_cu_seqlens()) if docs else None
    out = long_context_attention(ql, kl, vl, D ** -0.5, group, comm, packed)
    out.backward(dout.index_select(0, idx))
    errs = [(out.detach() - ref[0].index_select(0, idx)).abs().max().item()]
    errs += [(t.grad - r.index_select(0, idx)).abs().max().item() for t, r in zip((ql, kl, vl), ref[1:])]
    return max(errs)


def attention_errors():
    """{(cp, comm type, documents): max abs error over output and q/k/v grads} on this rank."""
    out = {}
    for cp in (2, 4):
        for comm in ("p2p", "allgather", "a2a"):
            for docs in (False, True):
                out[(cp, comm, docs)] = _cp_case(cp, comm, docs)
    out[(1, "none", True)] = _cp_case(1, "p2p", True)  # packed documents without CP
    return out


HIERARCHICAL = [[2, 2], [4, 1], [1, 4], [2, 1], [1, 2]]  # [a2a size, p2p size]; [4, 1] repeats K/V heads


def hierarchical_attention_errors():
    """{(a2a size, p2p size, documents): max abs error} of a2a+p2p on this rank (CP = a2a x p2p)."""
    return {(a, p, docs): _cp_case(a * p, "a2a+p2p", docs, [a, p]) for a, p in HIERARCHICAL for docs in (False, True)}


def _module_case(docs):
    """DotProductAttention with an explicit pg_collection (a2a+p2p [2, 2] over the 4 ranks) against SDPA."""
    from megatron.core.context_parallel import cp_local_indices
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    tp = [torch.distributed.new_group([r]) for r in range(world)][rank]
    pgs = ProcessGroupCollection(tp=tp, cp=torch.distributed.new_group(list(range(world))),
                                 hcp=_hierarchical_groups(world, [2, 2]))
    cfg = TransformerConfig(num_layers=1, hidden_size=N * D, num_attention_heads=N, num_query_groups=G,
                            context_parallel_size=world, hierarchical_context_parallel_sizes=[2, 2],
                            cp_comm_type="a2a+p2p", attention_dropout=0.0)
    attn = DotProductAttention(cfg, 1, AttnMaskType.causal, pg_collection=pgs)
    q, k, v, dout = _inputs(1)
    ref = _reference(q, k, v, dout, docs)
    idx = cp_local_indices(S, world, rank)
    ql, kl, vl = (t.index_select(0, idx).clone().requires_grad_() for t in (q, k, v))
    packed = PackedSeqParams(cu_seqlens_q=_cu_seqlens(), cu_seqlens_kv=_cu_seqlens()) if docs else None
    out = attn(ql, kl, vl, packed_seq_params=packed).view(len(idx), B, N, D)  # [s_local, b, n * d] -> heads
    out.backward(dout.index_select(0, idx))
    errs = [(out.detach() - ref[0].index_select(0, idx)).abs().max().item()]
    errs += [(t.grad - r.index_select(0, idx)).abs().max().item() for t, r in zip((ql, kl, vl), ref[1:])]
    return max(errs)


def module_errors():
    """{documents: max abs error} of DotProductAttention at a2a+p2p [2, 2] on this rank (needs 4 ranks)."""
    return {docs: _module_case(docs) for docs in (False, True)}
