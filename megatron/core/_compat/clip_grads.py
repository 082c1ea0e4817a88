"""Megatron Core's ``clip_grads`` helpers that this project's optimizers do not call: clipping and zero
counting over a plain list of params (the optimizers work on their main grads through
``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` / ``count_zeros_in_grads``). Reached from
``megatron.core.optimizer.clip_grads`` and ``megatron.core.optimizer`` through their lazy alias tables.
"""
from typing import Union

import torch

from megatron.core.optimizer.clip_grads import (
    _grads_of,
    clip_grad_by_total_norm_fp32,
    count_zeros_in_grads,
    get_grad_norm_fp32,
    param_counts_for_grad_stats,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate as not_tp_dup


def clip_grad_norm_fp32(parameters, max_norm: float, norm_type: Union[int, float] = 2,
                        grad_stats_parallel_group=None) -> float:
    """Clip `.grad` of `parameters` to a global norm `max_norm`; return the norm before clipping."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    grads_for_norm = [p.grad for p in params if param_counts_for_grad_stats(p)]
    total = get_grad_norm_fp32(grads_for_norm, norm_type, grad_stats_parallel_group)
    if max_norm > 0:
        clip_grad_by_total_norm_fp32(params, max_norm, total)
    return total


def count_zeros_fp32(parameters, grad_stats_parallel_group, use_decoupled_grad: bool = False, tp_group=None,
                     expert_tp_group=None) -> float:
    """Number of exactly-zero grad elements across `grad_stats_parallel_group` (`--log-num-zeros-in-grad`),
    each element counted once: shared params on the first stage, TP-replicated ones on TP rank 0
    (of `tp_group` / `expert_tp_group` when given)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    counted = [p for p in parameters if param_is_not_shared(p)
               and (not_tp_dup(p, tp_group, expert_tp_group) if tp_group is not None or expert_tp_group is not None
                    else param_is_not_tensor_parallel_duplicate(p))]
    return count_zeros_in_grads(_grads_of(counted, use_decoupled_grad), grad_stats_parallel_group)
