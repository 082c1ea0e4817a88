"""Routing math, load-balancing losses and token permutation shared by the router, dispatchers and experts.

Shapes: T tokens (sequence x batch, flattened), E experts, k = top-k. ``routing_map`` [T, E] is a bool
mask of the (token, expert) pairs kept; ``probs`` [T, E] holds their weights (zero elsewhere).
"""
import math
import warnings
from typing import Optional

import torch

from megatron.core.fusions import moe_permute, moe_router
from megatron.core.utils import lazy_names

_ROUTER_GATING = "megatron.core.transformer.moe.router_gating"
_MOE_LOGGING = "megatron.core.transformer.moe.moe_logging"
_COMPAT = "megatron.core._compat.moe_utils"
# Megatron's moe_utils path for names defined beside their users (router gating, the metrics tracker) and
# for its helpers this project does not call (the _compat room), resolved on first use.
__getattr__ = lazy_names(__name__, {
    "RouterGatingLinearFunction": _ROUTER_GATING, "router_gating_linear": _ROUTER_GATING,
    "RandomSTE": _ROUTER_GATING, "apply_random_logits": _ROUTER_GATING, "RandomSTEShared": _ROUTER_GATING,
    "apply_biased_logits": _ROUTER_GATING, "get_updated_expert_bias": _ROUTER_GATING,
    "save_to_aux_losses_tracker": _MOE_LOGGING, "clear_aux_losses_tracker": _MOE_LOGGING,
    "get_moe_layer_wise_logging_tracker": _MOE_LOGGING, "reduce_aux_losses_tracker_across_ranks": _MOE_LOGGING,
    "track_moe_metrics": _COMPAT, "get_default_pg_collection": _COMPAT, "get_align_size_for_quantization": _COMPAT,
    "skip_routed_expert_padding": _COMPAT, "get_tokens_per_expert_and_token_count": _COMPAT,
    "pad_routing_map": _COMPAT, "maybe_move_tensor_to_cpu": _COMPAT, "qb_dual_update": _COMPAT,
    "permute": _COMPAT, "unpermute": _COMPAT, "sort_chunks_by_idxs": _COMPAT,
})


def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens: int, topk: int,
                                    num_experts: int, moe_aux_loss_coeff: float, fused: bool = False,
                                    padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Switch-Transformer loss E * sum_i f_i * P_i with f_i = tokens_i / (T k) and P_i = sum(probs_i) / T.

    ``probs`` are this rank's tokens only while ``tokens_per_expert`` / ``total_num_tokens`` may cover a
    larger group (SP/TP ranks, a sequence, the global batch): summing the per-rank losses over that group
    gives the loss of the whole group, so the gradient is the same however the tokens are split.
    ``padding_mask`` [T] is True for tokens that count. ``fused`` (Transformer Engine's kernel for the
    same formula) computes the same value here."""
    if padding_mask is not None:
        probs = probs * padding_mask.unsqueeze(-1)
    aggregated = probs.sum(dim=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(aggregated * tokens_per_expert) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float, padding_mask: Optional[torch.Tensor] = None):
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2, times the coefficient.
    ``padding_mask`` [T] is True for padding tokens (Megatron's convention here), left out of the mean."""
    z = torch.square(torch.logsumexp(logits, dim=-1))
    if padding_mask is None:
        return torch.mean(z) * z_loss_coeff
    valid = ~padding_mask
    return (z * valid).sum() / torch.clamp(valid.sum(), min=1.0) * z_loss_coeff


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Balanced assignment weights by Sinkhorn-Knopp iteration on exp(cost) (rows: tokens, cols: experts)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1)).item()
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)




def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None):
    """Tokens one expert may take: ceil(num_tokens / num_experts * capacity_factor)."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    return max(capacity, min_capacity) if min_capacity is not None else capacity


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` whose backward also seeds ``aux_loss`` with the main loss's gradient scale,
    so an auxiliary loss joins backward without being added to the returned loss."""

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:  # no schedule set it (a layer used on its own): scale 1, no host-to-device copy
            return grad_output, torch.ones_like(aux_loss)
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor):
        """Gradient of the main loss w.r.t. itself as backward starts (loss scale / micro-batches)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().reshape(())


def group_limited_topk(scores, topk: int, num_tokens: int, num_experts: int, num_groups: int, group_topk: int):
    """DeepSeek-V3 routing: rank expert groups by the sum of their top (k / group_topk) scores, keep the best
    ``group_topk`` groups, and pick the top-k experts inside them. Returns (values, indices) [T, k]."""
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)  # [T, groups]
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    masked = scores.masked_fill(~score_mask.reshape(num_tokens, -1).bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return group_limited_topk(scores, topk, scores.shape[0], scores.shape[1], num_groups, group_topk)
    return torch.topk(scores, k=topk, dim=1)


def _select(scores, topk, num_groups, group_topk, precomputed_indices):
    """(selected scores, indices) [T, k]: the caller's indices when given, else the (group-limited) top-k."""
    if precomputed_indices is not None:
        return torch.gather(scores, dim=1, index=precomputed_indices), precomputed_indices
    return _topk(scores, topk, num_groups, group_topk)


def _positive_scores(logits, score_function):
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits.float()).sqrt()
    raise ValueError(f"moe_router_score_function '{score_function}' unknown; use softmax, sigmoid or sqrtsoftplus")


def topk_routing_with_score_function(logits, topk: int, use_pre_softmax: bool = False,
                                     num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                                     scaling_factor: Optional[float] = None, score_function: str = "softmax",
                                     expert_bias: Optional[torch.Tensor] = None, fused: bool = False,
                                     router_replay=None, dense_output: bool = False,
                                     precomputed_indices: Optional[torch.Tensor] = None):
    """(routing_probs [T, E], routing_map [T, E]) from router logits; scores computed in fp32.

    softmax: over all experts before top-k (pre_softmax) or over the k selected logits. sigmoid /
    sqrtsoftplus: per-expert scores, the selection optionally shifted by ``expert_bias`` (aux-loss-free
    balancing, which changes which experts win, never the weights), the k kept scores normalised to sum to
    one when k > 1. ``precomputed_indices`` [T, k] replaces the top-k selection; ``dense_output`` returns
    (probs [T, k], indices [T, k]) instead. ``fused`` (Transformer Engine's kernel) gives the same result
    here; ``router_replay`` (recorded routing, a debugging aid) is not implemented."""
    if router_replay is not None:
        raise NotImplementedError("router_replay (--moe-enable-routing-replay) is not implemented; pass None")
    if fused and precomputed_indices is not None:
        raise ValueError("precomputed_indices is not supported with the fused top-k score function")
    idx = precomputed_indices
    if score_function == "softmax":
        if use_pre_softmax:
            probs, top_indices = _select(torch.softmax(logits, dim=-1, dtype=torch.float32), topk, num_groups,
                                         group_topk, idx)
        else:
            scores, top_indices = _select(logits, topk, num_groups, group_topk, idx)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        scores = _positive_scores(logits, score_function)
        if expert_bias is not None and idx is None:
            _, top_indices = _topk(scores + expert_bias.float(), topk, num_groups, group_topk)
            scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            scores, top_indices = _select(scores, topk, num_groups, group_topk, idx)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    if dense_output:
        return probs, top_indices
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(logits, topk: int, score_function: str, fused: bool = False,
                                        padding_mask: Optional[torch.Tensor] = None):
    """(routing_map, scores) for the balancing losses: plain top-k over normalised scores, no bias or groups.
    Rows where ``padding_mask`` [T] is True (padding) are zeroed; ``fused`` gives the same result here."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = _positive_scores(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    if padding_mask is not None:
        valid = (~padding_mask).unsqueeze(-1)
        routing_map, scores = routing_map & valid, scores * valid
    return routing_map, scores


def apply_router_token_dropping(routing_probs, routing_map, router_topk: int, capacity_factor: float,
                                drop_policy: str = "probs", pad_to_capacity: bool = False):
    """Keep at most capacity = ceil(T k / E * factor) tokens per expert: those with the highest probs
    ('probs') or the earliest positions ('position'). With ``pad_to_capacity`` every expert gets exactly
    ``capacity`` slots; slots without a routed token carry probability 0 (their output is discarded)."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity >= num_tokens and not pad_to_capacity:
        return routing_probs, routing_map
    capacity = min(capacity, num_tokens)
    if drop_policy == "probs":
        _, idx = torch.topk(routing_probs, k=capacity, dim=0, sorted=False)
    elif drop_policy == "position":
        # Stable: among routed tokens (value 1) topk keeps the earliest positions first.
        order = routing_map.float() * 2 - torch.arange(num_tokens, device=routing_map.device).unsqueeze(1) / num_tokens
        _, idx = torch.topk(order, k=capacity, dim=0, sorted=False)
    else:
        raise ValueError(f"moe_token_drop_policy '{drop_policy}' unknown; use probs or position")
    capacity_mask = torch.zeros_like(routing_map).scatter(0, idx, True)
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map, final_map


# ---- permutation: tokens grouped by expert, without a per-expert loop -------------------------------

def refuse_host_read_in_capture(t: torch.Tensor, what: str) -> None:
    """Raise a clear error where ``what`` would read ``t`` on the host inside a CUDA-graph capture: the read
    itself would only fail with an invalidated capture, naming nothing."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"--cuda-graph-impl full_iteration: {what} reads token counts on the host inside the "
                           "captured step; use --moe-grouped-gemm with --bf16 on sm90+ (hidden and FFN sizes "
                           "multiples of 8), and --moe-pad-expert-input-to-capacity with a capacity factor")


def _permute_indices(routing_map: torch.Tensor, num_out_tokens: Optional[int]):
    """Positions into the flattened [E, T] map of its True entries, expert-major, token order within an
    expert. With ``num_out_tokens`` known (no dropping, or padded capacity) a stable sort finds them with
    no host sync; otherwise ``nonzero`` (one sync)."""
    flat = routing_map.t().reshape(-1)
    if num_out_tokens is None:
        refuse_host_read_in_capture(flat, "dropping tokens over capacity without padding")
        return flat.nonzero().squeeze(1)
    return torch.argsort((~flat).to(torch.int8), stable=True)[:num_out_tokens]


def _gather_sum(rows: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j rows[bags[t, j]], accumulated in fp32 and rounded once (the token-major way back of a
    permutation where every token has exactly k rows): a gather of the k rows into a [T, k, h] copy, then its sum.
    ``embedding_bag``'s sum reads each row once and writes only [T, h], yet measured slower at every MoE shape
    timed (MOE_FINE's, Mixtral's and Qwen3's, on H100 and H200: 1.2-2.3x the gather + sum), so it is not used."""
    picked = rows.index_select(0, bags.reshape(-1))
    return picked.view(*bags.shape, rows.shape[-1]).sum(1)


class _RepeatRows(torch.autograd.Function):
    """``tokens[sorted_indices]`` where every token appears exactly k times. Backward sums each token's k row
    gradients (``order``: the rows token-major) in fp32 (`_gather_sum`): no atomic ``index_add``, which contends
    on the k copies of a row and rounds after every add in bf16."""

    @staticmethod
    def forward(ctx, tokens, sorted_indices, order, k):
        ctx.save_for_backward(order)
        ctx.k = k
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _gather_sum(grad.contiguous(), order.view(-1, ctx.k)), None, None, None


class _SumTokenRows(torch.autograd.Function):
    """The unpermutation where every token has exactly k rows and no probabilities apply: each token's rows summed
    (`_gather_sum`, ``order`` [T, k] the rows token-major). Each row belongs to one token, so the backward is one
    gather of the output gradient by the rows' source tokens (``sorted_indices``), where autograd through a gather
    and a sum would materialise the [T, k, h] expansion and then gather it again."""

    @staticmethod
    def forward(ctx, rows, order, sorted_indices):
        ctx.save_for_backward(sorted_indices)
        return _gather_sum(rows.contiguous(), order)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        return grad.index_select(0, sorted_indices), None, None


class _PermuteRows(torch.autograd.Function):
    """``x[idx]`` for a permutation ``idx`` of the rows; backward is the gather by its inverse ``inv``."""

    @staticmethod
    def forward(ctx, x, idx, inv):
        ctx.save_for_backward(inv)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return grad.index_select(0, inv), None, None


def _token_major_order(sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Row positions sorted by source token (stable: expert order within a token). The keys are token indices
    below ``num_tokens``, so they are sorted as int16 (int32 beyond 32,767 tokens): a radix sort makes one pass
    per key byte, 2 instead of int64's 8 (twice per MoE layer and micro-batch; the same order)."""
    key_dtype = torch.int16 if num_tokens <= torch.iinfo(torch.int16).max + 1 else torch.int32
    return torch.argsort(sorted_indices.to(key_dtype), stable=True)


def _permute(tokens, routing_map, probs: Optional[torch.Tensor] = None, num_out_tokens: Optional[int] = None,
             topk: Optional[int] = None):
    """Group the rows of ``tokens`` [T, h] by expert. Returns (permuted [N, h], permuted probs [N] or None,
    sorted_indices [N]: the source token of each row). The dispatchers' form of Megatron's `permute`. ``topk``: every
    token has exactly that many rows (all experts in the map, no dropping): the backward gathers instead of
    scattering, and ``sorted_indices.token_order`` keeps the rows' token-major order for `_unpermute`."""
    num_tokens = routing_map.shape[0]
    flat_index = _permute_indices(routing_map, num_out_tokens)
    sorted_indices = flat_index % num_tokens
    if topk is not None and tokens.requires_grad:
        order = _token_major_order(sorted_indices, num_tokens)
        permuted = _RepeatRows.apply(tokens, sorted_indices, order, topk)
        sorted_indices.token_order = order  # `_unpermute` needs the same order: sorted once per micro-batch
    else:
        permuted = tokens.index_select(0, sorted_indices)
    permuted_probs = None if probs is None else probs.t().reshape(-1).index_select(0, flat_index)
    return permuted, permuted_probs, sorted_indices


def _unpermute(permuted_tokens, sorted_indices, restore_shape, probs: Optional[torch.Tensor] = None,
               topk: Optional[int] = None):
    """Inverse of `_permute`: each row (times its permuted prob [N]) is added back to its source token.
    ``topk`` (every token has exactly that many rows): the rows are gathered token-major and their k-way sum
    is one reduction with fp32 accumulation, instead of an ``index_add`` scatter."""
    if topk is not None:
        order = getattr(sorted_indices, "token_order", None)  # left by `_permute`
        if order is None:
            order = _token_major_order(sorted_indices, restore_shape[0])
    if topk is not None and probs is None:
        return _SumTokenRows.apply(permuted_tokens, order.view(-1, topk), sorted_indices).view(restore_shape)
    if topk is not None:  # with probabilities: each row scaled, then the token's k rows summed
        n = sorted_indices.numel()
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=order.device))
        rows = _PermuteRows.apply(permuted_tokens, order, inv).view(-1, topk, permuted_tokens.shape[-1])
        rows = rows * probs.index_select(0, order).view(-1, topk, 1).to(rows.dtype)
        return rows.sum(1).view(restore_shape)
    if probs is not None:
        permuted_tokens = permuted_tokens * probs.unsqueeze(-1).to(permuted_tokens.dtype)
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    return out.index_add(0, sorted_indices, permuted_tokens)








_FUSED_FNS = {}  # the fusion flags' functions, made once (each wraps its eager fallback)


def _fused_topk_routing(logits, topk: int, use_pre_softmax: bool = False, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None, scaling_factor: Optional[float] = None,
                        score_function: str = "softmax", expert_bias: Optional[torch.Tensor] = None,
                        fused: bool = False, router_replay=None, dense_output: bool = False,
                        precomputed_indices: Optional[torch.Tensor] = None):
    """`topk_routing_with_score_function` by the Triton kernels of `megatron.core.fusions.moe_router` (one per
    direction) where they cover the call; the eager function otherwise."""
    if (router_replay is None and not dense_output and precomputed_indices is None
            and moe_router.available(logits, topk, score_function, num_groups, group_topk)):
        return moe_router.route(logits, topk, score_function, use_pre_softmax, scaling_factor, expert_bias,
                                num_groups, group_topk)
    return topk_routing_with_score_function(
        logits, topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
        scaling_factor=scaling_factor, score_function=score_function, expert_bias=expert_bias, fused=fused,
        router_replay=router_replay, dense_output=dense_output, precomputed_indices=precomputed_indices)


def _fused_aux_scores(logits, topk: int, score_function: str, fused: bool = False,
                      padding_mask: Optional[torch.Tensor] = None):
    """`compute_routing_scores_for_aux_loss` by one Triton kernel per direction where they cover the call."""
    if padding_mask is None and moe_router.available(logits, topk, score_function):
        return moe_router.aux_scores(logits, topk, score_function)
    return compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=fused, padding_mask=padding_mask)


def fused_router_fns():
    """(routing, aux-loss scores) for --moe-router-fusion: `_fused_topk_routing` and `_fused_aux_scores`, the
    chain of small fp32 kernels (score function, top-k, normalisation, the scatters into [T, E]) as one kernel
    per direction each; eager on CPU, for what the kernels do not cover, and from the first failure on (a Triton
    that cannot build them here, said once)."""
    if "router" not in _FUSED_FNS:
        _FUSED_FNS["router"] = (
            _with_eager_fallback(_fused_topk_routing, topk_routing_with_score_function, "--moe-router-fusion",
                                 "the eager router", how="the fused router kernels"),
            _with_eager_fallback(_fused_aux_scores, compute_routing_scores_for_aux_loss, "--moe-router-fusion",
                                 "the eager router", how="the fused router kernels"))
    return _FUSED_FNS["router"]


def _fused_permute(tokens, routing_map, probs: Optional[torch.Tensor] = None, num_out_tokens: Optional[int] = None,
                   topk: Optional[int] = None):
    """`_permute` by the Triton kernels of `megatron.core.fusions.moe_permute` where routing is exactly top-k on
    CUDA (the same rows, order and ``sorted_indices``); `_permute` otherwise. The returned ``sorted_indices``
    carries ``token_rows`` [T, k] (each token's rows), the map `_fused_unpermute` gathers by: the dispatchers
    hand the same tensor from one to the other."""
    if topk is None or not moe_permute.available(tokens, routing_map.shape[1]):
        return _permute(tokens, routing_map, probs, num_out_tokens, topk)
    permuted, permuted_probs, sorted_indices, token_rows = moe_permute.permute(tokens, routing_map, probs, topk)
    sorted_indices.token_rows = token_rows
    return permuted, permuted_probs, sorted_indices


def _fused_unpermute(permuted_tokens, sorted_indices, restore_shape, probs: Optional[torch.Tensor] = None,
                     topk: Optional[int] = None):
    """`_unpermute` by one Triton kernel per direction where `_fused_permute` left its ``token_rows``;
    `_unpermute` otherwise."""
    token_rows = getattr(sorted_indices, "token_rows", None)
    if topk is None or token_rows is None or not moe_permute.available(permuted_tokens):
        return _unpermute(permuted_tokens, sorted_indices, restore_shape, probs, topk)
    return moe_permute.unpermute(permuted_tokens, token_rows, probs).view(restore_shape)


def fused_permute_fns():
    """(`_fused_permute`, `_fused_unpermute`) for --moe-permute-fusion: the permutation without sorts, a few
    launches instead of ~25 per MoE layer and micro-batch; the eager functions on CPU, for dropped or padded
    tokens, and from the first failure on (a Triton that cannot build the kernels here, said once)."""
    if "fns" not in _FUSED_FNS:
        _FUSED_FNS["fns"] = (_with_eager_fallback(_fused_permute, _permute, how="the fused permutation kernels"),
                            _with_eager_fallback(_fused_unpermute, _unpermute, how="the fused permutation kernels"))
    return _FUSED_FNS["fns"]


def _with_eager_fallback(compiled, eager, what="--moe-permute-fusion", instead="the eager permutation",
                         how="torch.compile"):
    """Run ``compiled``; if it fails to build (no working compiler on this machine), say so once (naming ``what``,
    ``how`` it was built and ``instead``) and use the eager function from then on (``call.state["fn"]``: the one
    in use)."""
    state = {"fn": compiled}

    def call(*args, **kwargs):
        try:
            return state["fn"](*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (any compiler failure)
            if state["fn"] is eager:
                raise
            warnings.warn(f"{what}: {how} failed ({type(e).__name__}: {e}); using {instead}")
            state["fn"] = eager
            return eager(*args, **kwargs)
    call.state = state
    return call


def _sort_chunks(input: torch.Tensor, split_sizes, sorted_idxs):
    """Reorder the row chunks of ``input`` (sizes ``split_sizes``, host ints) into the order ``sorted_idxs``."""
    chunks = torch.split(input, list(split_sizes), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)


def chunk_sort_indices(sizes: torch.Tensor, order: torch.Tensor, total: int):
    """The row permutation that puts chunk ``order[k]`` of a tensor k-th, as two index tensors computed on the
    device, so a reorder of many chunks is one gather instead of ``_sort_chunks``' split + cat (at 128 chunks,
    Qwen3-30B-A3B's shape at EP=2, the cat ran at a fifth of the copy bandwidth and its 128 views cost the
    host ~1 ms per call). ``sizes``: [n] int64, the chunks' row counts in the input's order, on the rows'
    device (no host read); ``order``: [n] int64 on the same device; ``total``: sum(sizes), known on the host.
    Returns (gather, inverse): ``x.index_select(0, gather)`` is the sorted tensor, and ``inverse`` undoes it
    (``_PermuteRows.apply(x, gather, inverse)``: the backward is the inverse gather)."""
    src_start = torch.cumsum(sizes, 0) - sizes
    sizes_sorted = sizes.index_select(0, order)
    dst_start_sorted = torch.cumsum(sizes_sorted, 0) - sizes_sorted
    rows = torch.arange(total, dtype=torch.int64, device=sizes.device)
    # Row r of sorted chunk k comes from src_start[order[k]] + (r - dst_start_sorted[k]).
    gather = rows + torch.repeat_interleave(src_start.index_select(0, order) - dst_start_sorted, sizes_sorted,
                                            output_size=total)
    dst_start = torch.empty_like(dst_start_sorted).index_copy_(0, order, dst_start_sorted)
    inverse = rows + torch.repeat_interleave(dst_start - src_start, sizes, output_size=total)
    return gather, inverse






def moe_layer_pattern(moe_layer_freq, num_layers: int):
    """[1 if layer i is an MoE layer else 0 for i in range(num_layers)] from Megatron's --moe-layer-freq:
    an int N (every N-th layer, starting at layer 0) or an explicit list."""
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ValueError(f"--moe-layer-freq ({moe_layer_freq}) must be >= 1")
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    pattern = list(moe_layer_freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(f"--moe-layer-freq pattern {pattern} must list one 0 (dense) or 1 (MoE) per layer "
                         f"({num_layers} layers)")
    return pattern
