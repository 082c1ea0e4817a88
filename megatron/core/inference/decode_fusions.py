"""The element-wise work of a decode step between the QKV projection and attention, as one compiled
kernel on CUDA (plain torch elsewhere, and inlined when the whole step is compiled).

Eagerly it is 4-7 small kernels per layer (RoPE's multiply / roll / multiply-add, the concatenation, the
cache write); at batch 1 each costs a few microseconds of a ~150-microsecond layer, whose weights are
the real work, so 32 layers of them are several percent of a step. Compiled, the rotation is computed
once and stored both as the queries and, with the value, into the KV cache.
"""
from typing import Optional

import torch

from megatron.core.fusions.compile import maybe_compile


@maybe_compile
def rope_and_store(x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], kv: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """x: the fused projection of one token per slot, [1, B, ng, np/ng + 2, hn] (per group its queries,
    key, value); cos / sin: [1, B, 1, 1, hn] with rotate-half's sign folded into sin, or None (no RoPE);
    kv: the layer's cache [slots, ng, max_len, 2, hn]; positions: [B].

    Writes slot i's rotated key and its value at positions[i] and returns the rotated queries
    [B, ng, np/ng, hn]."""
    rep = x.shape[3] - 2
    qk = x[0, :, :, :rep + 1]  # [B, ng, np/ng + 1, hn]: the queries and the key of each group
    if cos is not None:
        qk = torch.addcmul(qk * cos[0], torch.roll(qk, qk.shape[-1] // 2, dims=-1), sin[0])
    rows = torch.arange(x.shape[1], device=x.device)
    # An index_put on the whole cache (not a view of it): compiled, it becomes a store into the cache.
    kv[rows, :, positions] = torch.cat((qk[:, :, rep:], x[0, :, :, rep + 1:]), dim=2)  # [B, ng, 2, hn]
    return qk[:, :, :rep]
