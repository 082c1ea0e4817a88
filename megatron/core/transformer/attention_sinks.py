"""--softmax-type off-by-one / learnable: attention with a per-head sink logit (gpt-oss), in torch's SDPA kernels.

softmax over [sink, s_1 .. s_k] drops the sink's column: p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)), so a head
can attend to nothing. off-by-one fixes sink = 0 (softmax's "+1" in the denominator); learnable trains one sink per
head (``softmax_offset``, Megatron's parameter). The sink becomes one extra key that every query sees, with a zero
value: the head dim grows by 8 (one channel carries it, the rest keep the fused kernels' alignment), queries get a 1
in that channel and the sink key sink / scale, so the kernel's scale * q . k gives the sink logit exactly as the
extra score, and autograd carries its gradient. The masks gain a visible first column, so the kernel is torch's
masked one (memory-efficient on CUDA, not flash).
"""
from typing import Optional

import torch
import torch.nn.functional as F

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
_EXTRA = 8  # channels added to the head dim: one for the sink, the rest for 16-byte alignment


def with_sink(q, k, v, sink: torch.Tensor, scale: float, attn_mask: Optional[torch.Tensor], is_causal: bool):
    """(q, k, v, attn_mask) for SDPA with the sink key first, from q [b, n, sq, d], k / v [b, n, sk, d / dv]
    (heads already repeated for GQA), ``sink`` [n] and SDPA's bool ``attn_mask`` (True = attend) or ``is_causal``.
    The output's first dv channels are the attention with the sink; drop the rest."""
    b, n, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[-1]
    width = max(d, dv) + _EXTRA
    q = torch.cat([q, q.new_ones(b, n, sq, 1), q.new_zeros(b, n, sq, width - d - 1)], dim=-1)
    logit = (sink.float() / scale).to(k.dtype).view(1, n, 1, 1).expand(b, n, 1, 1)
    sink_key = torch.cat([k.new_zeros(b, n, 1, d), logit, k.new_zeros(b, n, 1, width - d - 1)], dim=-1)
    k = torch.cat([sink_key, F.pad(k, (0, width - d))], dim=2)  # [b, n, 1 + sk, width]
    v = F.pad(torch.cat([v.new_zeros(b, n, 1, dv), v], dim=2), (0, width - dv))
    if is_causal:  # SDPA's is_causal: query i sees keys 0..i
        attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        first = torch.ones(attn_mask.shape[:-1] + (1,), dtype=torch.bool, device=attn_mask.device)
        attn_mask = torch.cat([first, attn_mask], dim=-1)
    return q, k, v, attn_mask


def reference_sink_attention(q, k, v, sink, scale, allowed=None):
    """The formula in fp64 for tests: q [b, n, sq, d], k/v [b, n, sk, d], ``allowed`` [sq, sk] bool or None."""
    s = torch.einsum("bnqd,bnkd->bnqk", q.double(), k.double()) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    col = sink.double().view(1, -1, 1, 1).expand(s.shape[0], s.shape[1], s.shape[2], 1)
    p = torch.softmax(torch.cat([col, s], dim=-1), dim=-1)[..., 1:]
    return torch.einsum("bnqk,bnkd->bnqd", p, v.double())
