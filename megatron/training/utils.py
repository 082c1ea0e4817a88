"""Rank-aware printing and small helpers for the training application."""
import torch

from megatron.core import parallel_state
from megatron.core.utils import (
    lazy_names,
    unwrap_model,  # noqa: F401  (re-exported, Megatron's location)
)


def _dist():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_rank_safe():
    return torch.distributed.get_rank() if _dist() else 0


def get_world_size_safe():
    return torch.distributed.get_world_size() if _dist() else 1


def is_last_rank():
    return get_rank_safe() == get_world_size_safe() - 1


def print_rank_0(message):
    """Print once, from global rank 0."""
    if get_rank_safe() == 0:
        print(message, flush=True)


def print_rank_last(message):
    """Print once, from the last rank (it owns the loss on the last pipeline stage)."""
    if is_last_rank():
        print(message, flush=True)


def average_losses_across_data_parallel_group(losses):
    """Mean of scalar losses over the data-parallel group (legacy 2-tuple loss functions)."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    if _dist():
        torch.distributed.all_reduce(averaged, group=parallel_state.get_data_parallel_group())
        averaged = averaged / torch.distributed.get_world_size(group=parallel_state.get_data_parallel_group())
    return averaged


def report_memory(name, device_memory_used: bool = False):
    """One-line device memory report in MB (CUDA only; a note on CPU); ``device_memory_used``
    (--log-device-memory-used) adds the driver's count of the whole device's used memory, every process's."""
    if not torch.cuda.is_available():
        return f"{name} memory (MB) | not tracked on CPU"
    mb = 1024.0 * 1024.0
    line = (f"{name} memory (MB) | allocated: {torch.cuda.memory_allocated() / mb} | "
            f"max allocated: {torch.cuda.max_memory_allocated() / mb} | "
            f"reserved: {torch.cuda.memory_reserved() / mb} | "
            f"max reserved: {torch.cuda.max_memory_reserved() / mb}")
    if device_memory_used:
        line += f" | total device memory used: {torch.cuda.device_memory_used() / mb:.2f}"
    return line


def calc_params_l2_norm(model):
    """L2 norm of all parameters; TP-sharded params summed over TP, replicated ones counted once."""
    chunks = model if isinstance(model, list) else [model]
    sharded, replicated = 0.0, 0.0
    device = None
    for chunk in chunks:
        for p in chunk.parameters():
            device = p.device
            sq = p.detach().float().pow(2).sum()
            if hasattr(sq, "full_tensor"):  # FSDP2: sum of this DP shard -> sum over the DP group
                sq = sq.full_tensor()
            if getattr(p, "tensor_model_parallel", False):
                sharded = sharded + sq
            else:
                replicated = replicated + sq
    sharded_t = torch.as_tensor(sharded, dtype=torch.float, device=device)
    if _dist() and parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(sharded_t, group=parallel_state.get_tensor_model_parallel_group())
    total = sharded_t + torch.as_tensor(replicated, dtype=torch.float, device=device)
    if _dist() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total.sqrt().item()


# Megatron's other megatron.training.utils names: nothing here calls them, so they live in the compat room
# (megatron/training/_compat/utils.py); the autoresume check sits above checkpointing (autoresume.py).
_COMPAT = "megatron.training._compat.utils"
__getattr__ = lazy_names(__name__, {
    "is_rank0": _COMPAT,
    "warn_rank_0": _COMPAT,
    "get_ltor_masks_and_position_ids": _COMPAT,
    "get_blend_and_blend_per_split": _COMPAT,
    "is_first_or_last_pipeline_stage": _COMPAT,
    "logical_and_across_model_parallel_group": _COMPAT,
    "reduce_max_stat_across_model_parallel_group": _COMPAT,
    "print_params_min_max_norm": _COMPAT,
    "get_device_arch_version": _COMPAT,
    "to_empty_if_meta_device": _COMPAT,
    "update_use_dist_ckpt": _COMPAT,
    "is_hybrid_model": _COMPAT,
    "get_nvtx_range": _COMPAT,
    "has_nvrx_installed": _COMPAT,
    "has_nvrx_checkpointing_async_support": _COMPAT,
    "is_gtp_remat_active": _COMPAT,
    "append_to_progress_log": _COMPAT,
    "calc_dtensor_params_l2_norm": _COMPAT,
    "start_memory_history_recording": _COMPAT,
    "check_adlr_autoresume_termination": "megatron.training.autoresume",
})
