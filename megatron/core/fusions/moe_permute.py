"""--moe-permute-fusion: the MoE permutation and unpermutation in one Triton kernel per direction.

The eager permutation (``moe_utils._permute``) finds the expert-major row order by two stable sorts (the routing
map's [E * T] flags, then the rows' source tokens for the token-major way back) and moves rows with
``index_select``; with its index arithmetic and the unpermutation's sort, scatter and reduction that is ~25 kernel
launches per MoE layer and micro-batch, forward and backward, which host-bound expert-parallel steps pay in
launch time. Here the order comes from a running count instead of a sort: a token's row for expert e goes to
offset[e] + (tokens before it routed to e), the cumsum of the transposed routing map. One program per token
then writes its row to its k destinations (reading it once) and records them, ``token_rows`` [T, k]; the
unpermutation and both backwards gather or scatter a token's k rows in one program with fp32 sums in expert order
(deterministic, no atomics). The rows, their order and ``sorted_indices`` equal the eager permutation's.

Only for exactly top-k routing (every token k rows: no dropping, no padding), where ``token_rows`` is a complete
map; ``moe_utils.fused_permute_fns`` keeps the eager functions for the other cases and where Triton cannot build
kernels.
"""
from typing import Optional

import torch

from megatron.core.fusions.triton_loader import triton_loader


def _load():
    from megatron.core.fusions import _triton_moe_permute as k  # lazy: optional dependency (Triton)
    return k


_kernels = triton_loader(_load)


MAX_EXPERTS = 1024  # a token's map row is held in registers


def available(tokens: torch.Tensor, num_experts: int = 1) -> bool:
    """The kernels run here: a 2-D CUDA activation, at most MAX_EXPERTS experts, a Triton that builds kernels,
    outside torch.compile."""
    return (tokens.is_cuda and tokens.dim() == 2 and tokens.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and num_experts <= MAX_EXPERTS and not torch.compiler.is_compiling() and bool(_kernels()))


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs, routing_map, k):
        num_tokens, num_experts = routing_map.shape
        n = num_tokens * k
        routing_map = routing_map.contiguous()
        # Each expert's running count of its tokens, scanned along contiguous memory: torch's scan along dim 0
        # of [T, E] runs one thread per expert down all T rows.
        cum = torch.cumsum(routing_map.t().contiguous(), 1, dtype=torch.int32)  # [E, T]
        counts = cum[:, -1]
        offs = torch.cumsum(counts, 0, dtype=torch.int32) - counts
        x = tokens.contiguous()
        out = x.new_empty(n, x.shape[1])
        out_probs = None if probs is None else probs.new_empty(n)
        sorted_indices = torch.empty(n, dtype=torch.int64, device=x.device)
        token_rows = torch.empty(num_tokens, k, dtype=torch.int32, device=x.device)
        token_experts = torch.empty_like(token_rows)
        _kernels().permute(x, routing_map.view(torch.uint8), cum, offs, None if probs is None else probs.contiguous(),
                           out, out_probs, sorted_indices, token_rows, token_experts)
        ctx.save_for_backward(token_rows, token_experts)
        ctx.num_experts = num_experts
        ctx.mark_non_differentiable(sorted_indices, token_rows)
        return out, out_probs, sorted_indices, token_rows

    @staticmethod
    def backward(ctx, grad_out, grad_probs, _sorted, _rows):
        token_rows, token_experts = ctx.saved_tensors
        num_tokens, k = token_rows.shape
        dx = dp = None
        if ctx.needs_input_grad[0] and grad_out is not None:
            grad_out = grad_out.contiguous()
            dx = grad_out.new_empty(num_tokens, grad_out.shape[1])
            _kernels().gather_sum(grad_out, token_rows, None, dx)
        if ctx.needs_input_grad[1] and grad_probs is not None:
            picked = grad_probs.index_select(0, token_rows.view(-1)).view(num_tokens, k)
            dp = grad_probs.new_zeros(num_tokens, ctx.num_experts).scatter_(1, token_experts.long(), picked)
        return dx, dp, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, probs, token_rows):
        rows = rows.contiguous()
        probs = None if probs is None else probs.contiguous()
        out = rows.new_empty(token_rows.shape[0], rows.shape[1])
        _kernels().gather_sum(rows, token_rows, probs, out)
        ctx.save_for_backward(token_rows, probs, rows if probs is not None else None)
        return out

    @staticmethod
    def backward(ctx, grad):
        token_rows, probs, rows = ctx.saved_tensors
        grad = grad.contiguous()
        dy = grad.new_empty(token_rows.numel(), grad.shape[1])
        dp = None if probs is None else torch.empty_like(probs)
        _kernels().scatter(grad, token_rows, probs, rows, dy, dp)
        return dy, dp, None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor], topk: int):
    """Rows of ``tokens`` [T, h] grouped by expert (``routing_map`` [T, E] bool with exactly ``topk`` True per
    row). Returns (permuted [T * topk, h], permuted probs [T * topk] or None, sorted_indices [T * topk] int64: the
    source token of each row, token_rows [T, topk] int32: each token's rows in expert order)."""
    return _Permute.apply(tokens, probs, routing_map, topk)


def unpermute(rows: torch.Tensor, token_rows: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's rows (times their permuted ``probs`` [N]) summed in fp32: [T, h] in the rows' dtype."""
    return _Unpermute.apply(rows, probs, token_rows)
