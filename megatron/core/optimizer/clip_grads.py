"""Global gradient norm, clipping and zero counting over the model-parallel (and DP-shard) groups.

Each distinct gradient element must be counted exactly once across the ranks a reduction spans:
params replicated across TP (norms, biases of row-parallel layers) count only on TP rank 0, and a
tied output weight that duplicates the word embedding counts only on the first pipeline stage.
"""
import math
from typing import List, Sequence, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import lazy_names

# Megatron's whole-model helpers that the optimizers here do not call (they count and clip their main
# grads with the functions below), resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.clip_grads"
                                    for name in ("clip_grad_norm_fp32", "count_zeros_fp32")})


def param_is_not_tensor_parallel_duplicate(param) -> bool:
    """TP-split params count everywhere; replicated ones on TP rank 0 (expert-TP rank 0 for experts)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not getattr(param, "allreduce", True):
        return parallel_state.get_expert_tensor_parallel_rank() == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def param_is_not_shared(param) -> bool:
    """A `shared` param (tied embedding/output weight) counts once: on the first pipeline stage."""
    return not getattr(param, "shared", False) or parallel_state.is_pipeline_first_stage(ignore_virtual=True)


def param_counts_for_grad_stats(param) -> bool:
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)


def _groups(group) -> List:
    if group is None:
        return []
    groups = list(group) if isinstance(group, (list, tuple)) else [group]
    return [g for g in groups if g is not None]  # None: no process group (a single process)


def _all_reduce(tensor, groups, op=dist.ReduceOp.SUM):
    for group in groups:
        if dist.get_world_size(group=group) > 1:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def get_grad_norm_fp32(grads_for_norm: Sequence[torch.Tensor], norm_type: Union[int, float] = 2,
                       grad_stats_parallel_group=None, as_tensor: bool = False):
    """Norm of the concatenation of `grads_for_norm` across every rank of the given group(s): a float, or with
    ``as_tensor`` a float64 device scalar holding the same value, without reading it back to the host."""
    norm_type = float(norm_type)
    groups = _groups(grad_stats_parallel_group)
    device = grads_for_norm[0].device if grads_for_norm else _default_device()
    if norm_type == math.inf:
        grads_for_norm = [g.to_local() if hasattr(g, "to_local") else g for g in grads_for_norm]
        local = max((g.detach().abs().max().float() for g in grads_for_norm if g.numel()),
                    default=torch.zeros((), device=device))
        total = _all_reduce(torch.as_tensor(local, dtype=torch.float32, device=device).reshape(1),
                            groups, dist.ReduceOp.MAX)
        return total[0].double() if as_tensor else total.item()
    total = torch.zeros(1, dtype=torch.float32, device=device)
    # FSDP2: the local shard of a DTensor. One multi-tensor norm kernel instead of a launch per grad.
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads_for_norm]
    local = [g.detach().float() for g in local if g.numel()]
    if local:
        norms = torch._foreach_norm(local, norm_type)
        total += torch.stack(norms).pow(norm_type).sum()
    _all_reduce(total, groups)
    if as_tensor:  # float64, as the host's float arithmetic below
        return total[0].double() ** (1.0 / norm_type)
    return total.item() ** (1.0 / norm_type)


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """The factor Megatron scales grads by: max_norm / (total_norm + 1e-6), applied only when below 1."""
    return max_norm / (total_norm + 1.0e-6)


def _grads_of(parameters, use_decoupled_grad=False) -> List[torch.Tensor]:
    """The (local shard of the) gradient of each param that has one: `.grad`, or `.decoupled_grad`."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr, None) for p in parameters]
    return [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]


def clip_grad_by_total_norm_fp32(parameters, max_norm: Union[int, float], total_norm: float,
                                 use_decoupled_grad: bool = False):
    """Scale the params' grads (`.decoupled_grad` with `use_decoupled_grad`) in place by
    max_norm / (total_norm + 1e-6) when that is below 1. `total_norm` may be a tensor (no host sync)."""
    grads = [g.detach() for g in _grads_of(parameters, use_decoupled_grad)]
    clip_coeff = clip_coefficient(max_norm, total_norm)
    if isinstance(clip_coeff, torch.Tensor):
        if grads:
            torch._foreach_mul_(grads, clip_coeff.clamp_max(1.0).to(grads[0].device))
    elif clip_coeff < 1.0 and grads:  # a DistOpt rank may own no grads
        torch._foreach_mul_(grads, clip_coeff)






def count_zeros_in_grads(grads_for_count: Sequence[torch.Tensor], grad_stats_parallel_group=None) -> float:
    """Zero elements of the given gradient tensors, summed over the given group(s)."""
    device = grads_for_count[0].device if grads_for_count else _default_device()
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads_for_count:
        g = g.to_local() if hasattr(g, "to_local") else g
        total += g.numel() - torch.count_nonzero(g)
    return _all_reduce(total, _groups(grad_stats_parallel_group)).item()


def _default_device() -> torch.device:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
