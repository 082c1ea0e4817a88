"""The router's gating pieces: the gate's linear in the router dtype, random logits for load-balance
benchmarks (--moe-router-force-load-balancing / -biased), and the aux-loss-free expert-bias update.

Megatron's import path for these names is ``moe_utils`` (its lazy alias table points here).
"""
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
)


class RouterGatingLinearFunction(torch.autograd.Function):
    """logits = inp W^T (+ b) computed in ``router_dtype`` (fp32/fp64) from low-precision inputs; only the
    inputs are saved, not their high-precision copies, and the gradients come back in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, inp, weight, bias, router_dtype):
        ctx.save_for_backward(inp, weight, bias)
        ctx.router_dtype = router_dtype
        x = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
        w = weight.to(router_dtype)
        out = torch.mm(x, w.t()) if bias is None else torch.addmm(bias.to(router_dtype), x, w.t())
        return out.view(*inp.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight, bias = ctx.saved_tensors
        dtype = ctx.router_dtype
        grad = grad_output.reshape(-1, grad_output.shape[-1]).to(dtype)
        grad_input = torch.mm(grad, weight.to(dtype)).to(inp.dtype).view(inp.shape)
        grad_weight = torch.mm(grad.t(), inp.reshape(-1, inp.shape[-1]).to(dtype)).to(weight.dtype)
        grad_bias = None if bias is None else grad.sum(dim=0).to(bias.dtype)
        return grad_input, grad_weight, grad_bias, None


def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         router_dtype: torch.dtype) -> torch.Tensor:
    return RouterGatingLinearFunction.apply(inp, weight, bias, router_dtype)


class RandomSTE(torch.autograd.Function):
    """Random normal logits (a different stream per expert-parallel rank) with a straight-through
    gradient: --moe-router-force-load-balancing benchmarks balanced routing with real router gradients."""

    @staticmethod
    def forward(ctx, logits):
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            return logits.clone().normal_()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def apply_random_logits(logits: torch.Tensor) -> torch.Tensor:
    return RandomSTE.apply(logits)


class RandomSTEShared(torch.autograd.Function):
    """Adds one random per-expert bias (same on every rank: the data-parallel RNG stream) with a
    straight-through gradient; with std < 0 the bias of each layer is drawn once and reused."""

    _cache = {}

    @staticmethod
    def forward(ctx, logits, std, layer_number):
        cache = RandomSTEShared._cache
        if std < 0 and layer_number in cache:
            return logits + cache[layer_number]
        with get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
            bias = torch.empty(logits.shape[-1], device=logits.device, dtype=logits.dtype).normal_(std=abs(std))
        if std < 0 and layer_number is not None:
            cache[layer_number] = bias
        return logits + bias

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None


def apply_biased_logits(logits, std, layer_number=None):
    """Random logits plus a shared random bias (--moe-router-force-biased): a skewed expert load."""
    return RandomSTEShared.apply(apply_random_logits(logits), std, layer_number)


@torch.no_grad()
def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                            expert_bias_update_rate: float, tp_dp_cp_group=None) -> torch.Tensor:
    """Aux-loss-free balancing step: counts summed over ``tp_dp_cp_group`` (in place), then each expert's
    bias moves by +rate if it got fewer tokens than the mean of its row, -rate if more."""
    if tp_dp_cp_group is None:
        tp_dp_cp_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if tp_dp_cp_group is not None and dist.get_world_size(tp_dp_cp_group) > 1:
        dist.all_reduce(tokens_per_expert, group=tp_dp_cp_group)
    offset = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1] - tokens_per_expert
    return expert_bias + torch.sign(offset) * expert_bias_update_rate
