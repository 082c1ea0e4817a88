"""--moe-router-fusion: the router's top-k routing and the balancing losses' scores in one Triton kernel per
direction each.

The eager routing (``moe_utils.topk_routing_with_score_function``) is a chain of small kernels per MoE layer and
micro-batch: the score function, top-k (group-limited: two more top-k's and the masks), the normalisation, two
zero-fills and two scatters into [T, E], and the same again for the balancing losses' scores; their backwards
add as many. Host-bound expert-parallel steps pay each launch. Here one program per token does the whole
forward in registers and writes its rows of the probabilities and the routing map; the backward recomputes the
scores from the logits. The values equal the eager functions' to fp32 rounding (a tie between two scores goes to
the lower expert index, where torch.topk leaves the order open).

Covered: softmax (before or after the selection), sigmoid and sqrt(softplus) scores, the expert bias, DeepSeek-V3's
group limit, the scaling factor, up to 1,024 experts. ``moe_utils.fused_router_fns`` keeps the eager functions
for the rest (precomputed indices, dense outputs, a padding mask) and where Triton cannot build kernels.
"""
from typing import Optional

import torch

from megatron.core.fusions.triton_loader import triton_loader


def _load():
    from megatron.core.fusions import _triton_moe_router as k  # lazy: optional dependency (Triton)
    return k


_kernels = triton_loader(_load)
MAX_EXPERTS = 1024


def available(logits: torch.Tensor, topk: int, score_function: str, num_groups: Optional[int] = None,
              group_topk: Optional[int] = None) -> bool:
    """The kernels cover this routing here: 2-D CUDA logits, a known score function, the group limit's sizes
    consistent, a Triton that builds kernels, outside torch.compile."""
    experts = logits.shape[-1]
    if logits.dim() != 2 or not logits.is_cuda or score_function not in ("softmax", "sigmoid", "sqrtsoftplus"):
        return False
    if not 0 < topk <= experts <= MAX_EXPERTS or torch.compiler.is_compiling():
        return False
    if group_topk:
        if not num_groups or experts % num_groups or topk % group_topk or group_topk > num_groups:
            return False
    return bool(_kernels())


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, expert_bias, topk, score, pre, scaling, groups, group_topk):
        logits = logits.contiguous()
        probs = torch.empty_like(logits)
        routing_map = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
        bias = None if expert_bias is None else expert_bias.detach().float().contiguous()
        _kernels().route_forward(logits, bias, probs, routing_map.view(torch.uint8), topk, score, pre, scaling,
                                 groups if group_topk else None, group_topk)
        ctx.save_for_backward(logits, routing_map)
        ctx.args = (topk, score, pre, scaling)
        ctx.mark_non_differentiable(routing_map)
        return probs, routing_map

    @staticmethod
    def backward(ctx, dprobs, _map):
        logits, routing_map = ctx.saved_tensors
        dlogits = torch.empty_like(logits)
        _kernels().route_backward(logits, routing_map.view(torch.uint8), dprobs.contiguous(), dlogits, *ctx.args)
        return dlogits, None, None, None, None, None, None, None


class _AuxScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, score):
        logits = logits.contiguous()
        scores = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        routing_map = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
        _kernels().aux_forward(logits, scores, routing_map.view(torch.uint8), topk, score)
        ctx.save_for_backward(logits)
        ctx.score = score
        ctx.mark_non_differentiable(routing_map)
        return routing_map, scores

    @staticmethod
    def backward(ctx, _map, dscores):
        (logits,) = ctx.saved_tensors
        dlogits = torch.empty_like(logits)
        _kernels().aux_backward(logits, dscores.contiguous(), dlogits, ctx.score)
        return dlogits, None, None


def route(logits: torch.Tensor, topk: int, score_function: str = "softmax", use_pre_softmax: bool = False,
          scaling_factor: Optional[float] = None, expert_bias: Optional[torch.Tensor] = None,
          num_groups: Optional[int] = None, group_topk: Optional[int] = None):
    """(routing probabilities [T, E] in the logits' dtype, routing map [T, E] bool), as
    ``topk_routing_with_score_function`` gives them."""
    bias = expert_bias if score_function != "softmax" else None  # the softmax routing takes no bias
    return _Route.apply(logits, bias, topk, score_function, use_pre_softmax, scaling_factor, num_groups, group_topk)


def aux_scores(logits: torch.Tensor, topk: int, score_function: str):
    """(routing map [T, E] bool, scores [T, E] fp32), as ``compute_routing_scores_for_aux_loss`` gives them."""
    return _AuxScores.apply(logits, topk, score_function)
