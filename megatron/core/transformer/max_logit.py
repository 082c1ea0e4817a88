"""The per-head maximum pre-softmax attention logit (scale * q.k over visible keys), for QK-clip and
``--log-max-attention-logit``.

Megatron reads it from Transformer Engine's fused attention (``return_max_logit``); the SDPA / flash kernels
used here do not return it, so it is computed alongside, eagerly, over tiles of queries x keys: the
[s, s] logit matrix never exists, only one tile of at most ``TILE_ELEMENTS`` logits. Tiles that the causal
mask or the sliding window hide entirely are skipped, and position masks are built only for tiles that cross
the diagonal or a window edge. Masks: causal, sliding window, packed documents
(document ids) and an explicit boolean mask (True = masked, Megatron's convention).
"""
from typing import Optional, Tuple

import torch

from megatron.core.context_parallel.utils import cp_chunk_ids, cp_gather_order

TILE_ELEMENTS = 1 << 25  # logits per tile over batch x heads x queries x keys (64 MiB in bf16)


def _tile_sizes(b, heads, sq, sk, block_q, block_k):
    bk = block_k or min(sk, 1024)
    bq = block_q or max(1, min(sq, TILE_ELEMENTS // max(1, b * heads * bk)))
    return bq, bk


@torch.no_grad()
def max_attention_logit(query: torch.Tensor, key: torch.Tensor, scale: float, causal: bool = True,
                        q_start: Optional[int] = None, attention_mask: Optional[torch.Tensor] = None,
                        q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None,
                        window: Optional[Tuple[int, int]] = None, block_q: Optional[int] = None,
                        block_k: Optional[int] = None) -> torch.Tensor:
    """Per-head max over batch, queries and visible keys of ``scale * q.k``, fp32 [np] (-inf for a head
    that sees no key).

    query [sq, b, np, hn]; key [sk, b, ng, hn] (GQA: query head h uses key group h // (np / ng)).
    The queries sit at key positions ``q_start .. q_start + sq - 1`` (default ``sk - sq``: the last ones).
    ``attention_mask``: bool, broadcastable to [b, np, sq, sk], True = masked. ``q_doc`` [b, sq] and
    ``k_doc`` [b, sk]: document ids; a query sees only keys of its own document. ``window``: Megatron's
    ``(left, right)`` sliding window (-1 unbounded).
    """
    sq, b, np_, hn = query.shape
    sk, ng = key.shape[0], key.shape[2]
    rep = np_ // ng
    q_start = sk - sq if q_start is None else q_start
    # [s, b, n, d] -> [b, ng, rep, sq, d] and [b, ng, 1, sk, d]: one matmul covers a whole query group.
    q = query.detach().permute(1, 2, 0, 3).reshape(b, ng, rep, sq, hn)
    k = key.detach().permute(1, 2, 0, 3).unsqueeze(2)
    mask = None
    if attention_mask is not None:
        mask = attention_mask.expand(b, np_, sq, sk).reshape(b, ng, rep, sq, sk)
    left, right = window if window is not None else (-1, -1)
    bq, bk = _tile_sizes(b, np_, sq, sk, block_q, block_k)
    best = torch.full((ng, rep), float("-inf"), dtype=torch.float32, device=query.device)
    for q0 in range(0, sq, bq):
        q1 = min(sq, q0 + bq)
        first, last = q_start + q0, q_start + q1 - 1  # key positions of the tile's first and last query
        qpos = torch.arange(first, last + 1, device=query.device)[:, None]  # [tq, 1]
        for k0 in range(0, sk, bk):
            k1 = min(sk, k0 + bk)
            if causal and k0 > last or right >= 0 and k0 > last + right or left >= 0 and k1 - 1 < first - left:
                continue  # every logit of this tile is masked
            logits = torch.matmul(q[:, :, :, q0:q1], k[:, :, :, k0:k1].transpose(-1, -2))  # [b, ng, rep, tq, tk]
            # Masks on positions only where the tile crosses the diagonal or a window edge: below the diagonal
            # a causal tile is fully visible and goes straight to the max.
            cut_causal = causal and k1 - 1 > first
            cut_left = left >= 0 and k0 < last - left
            cut_right = right >= 0 and k1 - 1 > first + right
            keep = None
            if cut_causal or cut_left or cut_right:
                kpos = torch.arange(k0, k1, device=query.device)[None, :]
                keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=query.device)
                if cut_causal:
                    keep &= kpos <= qpos
                if cut_left:
                    keep &= kpos >= qpos - left
                if cut_right:
                    keep &= kpos <= qpos + right
            if q_doc is not None:
                same = (q_doc[:, q0:q1, None] == k_doc[:, None, k0:k1])[:, None, None]  # [b, 1, 1, tq, tk]
                keep = same if keep is None else keep & same
            if mask is not None:
                visible = ~mask[:, :, :, q0:q1, k0:k1]
                keep = visible if keep is None else keep & visible
            if keep is not None:
                logits = logits.masked_fill(~keep, float("-inf"))
            best = torch.maximum(best, logits.amax(dim=(0, 3, 4)).float())
    # max(scale * x) = scale * max(x) for scale > 0: scaling once keeps the tile in the input dtype.
    return best.reshape(np_) * scale


@torch.no_grad()
def context_parallel_max_attention_logit(query, key, scale, cp_group, layout=None):
    """The max over this CP rank's queries (two load-balanced chunks) against the whole sequence's keys,
    all-gathered over ``cp_group`` (no gradient, no [S, S] matrix); [np]. Reduce it with MAX over the CP
    group for the max of the whole sequence (QK-clip reduces over DP x CP)."""
    cp, rank = torch.distributed.get_world_size(cp_group), torch.distributed.get_rank(cp_group)
    parts = [torch.empty_like(key) for _ in range(cp)]
    torch.distributed.all_gather(parts, key.detach().contiguous(), group=cp_group)
    full = torch.cat(parts, dim=0)  # [S, b, ng, hn] in rank order
    full = full.index_select(0, torch.argsort(cp_gather_order(full.size(0), cp, key.device)))  # natural order
    c = query.size(0) // 2
    best = None
    for local, chunk in enumerate(cp_chunk_ids(cp, rank)):
        qs = slice(local * c, (local + 1) * c)
        q_doc = k_doc = None
        if layout is not None:
            q_doc, k_doc = layout.doc[:, chunk * c:(chunk + 1) * c], layout.doc
        # Keys after the chunk are all masked (causal): hand over only those up to its end.
        m = max_attention_logit(query[qs], full[:(chunk + 1) * c], scale, causal=True, q_start=chunk * c,
                                q_doc=q_doc, k_doc=None if k_doc is None else k_doc[:, :(chunk + 1) * c])
        best = m if best is None else torch.maximum(best, m)
    return best
