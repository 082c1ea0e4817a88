"""Attention restricted to documents packed into one sequence (no context parallelism).

CUDA: FlexAttention, compiled, with a block mask built from the document ids, so blocks that cross a
document boundary are skipped and no [s, s] mask exists. Elsewhere: the math kernel with the document
mask (CPU runs are small; FlexAttention has no CPU backward).
"""
import torch

from megatron.core.context_parallel.kernels import BlockMask, document_block_mask, flex_attention_lse, math_forward


def document_attention(q, k, v, scale, layout):
    """q: [b, n, S, d]; k, v: [b, g, S, d]; ``layout``: DocumentLayout of the full sequence."""
    seq = q.size(2)
    pos = torch.arange(seq, device=q.device)
    mask = BlockMask(True, layout.doc, layout.doc, pos, pos)
    if q.device.type == "cuda":
        cache = layout.__dict__.setdefault("_block_masks", {})
        if seq not in cache:  # one block mask per micro-batch, shared by every layer
            cache[seq] = document_block_mask(mask, seq, seq)
        out, _ = flex_attention_lse(q, k, v, cache[seq], scale)
        return out
    out, _ = math_forward(q, k, v, scale, mask)
    return out.to(q.dtype)
