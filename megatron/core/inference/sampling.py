"""Next-token choice for a batch whose rows each have their own temperature / top-k / top-p.

Sampling is an inverse-CDF lookup with one uniform number per row drawn on the host from the request's
own generator, so a seeded request samples the same tokens whatever else shares its batch, and the
whole function (no host syncs, static shapes) can sit inside a captured CUDA graph.
"""
import torch


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  uniform: torch.Tensor, greedy_only: bool) -> torch.Tensor:
    """logits [B, V] fp32; temperature/top_p/uniform [B] fp32, top_k [B] int64 -> tokens [B] int64.

    Rows with top_k == 1 or temperature == 0 take the argmax; top_k == 0 / top_p == 0 keep every token."""
    greedy = logits.argmax(dim=-1)
    if greedy_only:
        return greedy
    v = logits.size(-1)
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(v, device=logits.device)[None, :]
    keep = (ranks < top_k[:, None]) | (top_k[:, None] <= 0)
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the mass *before* a token is < top_p).
    before = torch.cumsum(probs, dim=-1) - probs
    keep = keep & ((before < top_p[:, None]) | (top_p[:, None] <= 0))
    cdf = torch.cumsum(probs * keep, dim=-1)  # [B, V], non-decreasing
    target = (uniform * cdf[:, -1])[:, None]
    choice = torch.searchsorted(cdf, target, right=True).clamp_max(v - 1)  # first index with cdf > target
    sampled = order.gather(1, choice).squeeze(1)
    is_greedy = (top_k == 1) | (temperature == 0)
    return torch.where(is_greedy, greedy, sampled)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per row (raw logits, before temperature, as Megatron reports)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
