"""Megatron-LM's other ``megatron.training.utils`` helpers, for scripts written against Megatron-LM.

Nothing in this application calls them; ``megatron.training.utils`` resolves them here on first use.
"""
import contextlib
import datetime
import importlib.util
import json
import os
import warnings

import torch

from megatron.core import parallel_state as ps
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.utils import get_device, nvtx_range_pop, nvtx_range_push
from megatron.training.utils import get_rank_safe, get_world_size_safe


def _dist():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_rank0():
    return get_rank_safe() == 0


def warn_rank_0(message, rank=None):
    """warnings.warn on rank 0 (of `rank` when given, else of torch.distributed)."""
    if (rank if rank is not None else get_rank_safe()) == 0:
        warnings.warn(message)


def get_ltor_masks_and_position_ids(data, eod_token, pad_token, reset_position_ids, reset_attention_mask,
                                    eod_mask_loss, pad_mask_loss):
    """Left-to-right masks for a [b, s] token batch: attention mask [b or 1, 1, s, s] (True = masked),
    loss mask [b, s] (0 at EOD / pad tokens when asked) and position ids [b, s] (restarting after EOD
    with `reset_position_ids`; `reset_attention_mask` also cuts attention at document ends)."""
    masks, losses, positions = [], [], []
    for row in data:
        mask, loss, pos = _get_ltor_masks_and_position_ids(row, eod_token, reset_position_ids,
                                                           reset_attention_mask, eod_mask_loss, True)
        if pad_mask_loss:
            loss[row == pad_token] = 0.0
        masks.append(mask)
        losses.append(loss)
        positions.append(pos)
    attention_mask = torch.stack(masks) if reset_attention_mask else masks[0].unsqueeze(0)
    return attention_mask, torch.stack(losses), torch.stack(positions)


def get_blend_and_blend_per_split(args):
    """(blend, blend_per_split) for the dataset config from --data-path / --data-args-path or the
    per-split paths (--train/valid/test-data-path, --per-split-data-args-path)."""
    blend = blend_per_split = None
    if args.data_path is not None or getattr(args, "data_args_path", None) is not None:
        if getattr(args, "data_args_path", None) is not None:
            with open(args.data_args_path) as f:
                blend = get_blend_from_list(f.read().split())
        else:
            blend = get_blend_from_list(args.data_path)
    elif getattr(args, "per_split_data_args_path", None) is not None:
        with open(args.per_split_data_args_path) as f:
            per_split = json.load(f)
        blend_per_split = [get_blend_from_list(per_split[s].split() if isinstance(per_split[s], str)
                                               else per_split[s]) for s in ("train", "valid", "test")]
    elif any(p is not None for p in (args.train_data_path, args.valid_data_path, args.test_data_path)):
        blend_per_split = [get_blend_from_list(p) for p in
                           (args.train_data_path, args.valid_data_path, args.test_data_path)]
    return blend, blend_per_split


def is_first_or_last_pipeline_stage(vp_stage):
    """Whether this rank (virtual stage `vp_stage`, when given) is the first or last pipeline stage."""
    ignore_virtual = vp_stage is None
    return (ps.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
            or ps.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage))


def _model_parallel_all_reduce(value, op, group):
    group = group if group is not None else ps.get_model_parallel_group()
    tensor = torch.tensor([value], dtype=torch.float64, device=get_device())
    if group is not None:
        torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor.item()


def logical_and_across_model_parallel_group(input: bool, group=None) -> bool:
    """True when `input` is True on every rank of the model-parallel group."""
    return bool(_model_parallel_all_reduce(1.0 if input is True else 0.0, torch.distributed.ReduceOp.MIN, group))


def reduce_max_stat_across_model_parallel_group(stat, group=None):
    """Max of `stat` over the model-parallel group; ranks without the stat pass None (None if all do)."""
    value = _model_parallel_all_reduce(-1.0 if stat is None else float(stat), torch.distributed.ReduceOp.MAX,
                                       group)
    return None if value == -1.0 else value


def print_params_min_max_norm(optimizer, iteration):
    """Print min, max and L2 norm of every parameter of the optimizer's groups."""
    rank = get_rank_safe()
    lines = ["iteration, rank, index, tensor-model-parallel, min, max, norm"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, p in enumerate(params, start=1):
        tp = int(getattr(p, "tensor_model_parallel", False))
        lines.append(f"{iteration:7d}, {rank:4d}, {index:4d}, {tp:2d}, {p.data.min():.6E}, {p.data.max():.6E}, "
                     f"{torch.linalg.norm(p.data):.6E}")
    print("\n".join(lines), flush=True)


def get_device_arch_version():
    """Major CUDA compute capability of device 0 (8: Ampere, 9: Hopper, 10: Blackwell)."""
    return torch.cuda.get_device_properties(torch.device("cuda:0")).major


def to_empty_if_meta_device(module: torch.nn.Module, *, device: torch.device, recurse=True):
    """Materialise meta tensors as empty tensors on `device`; move the others there unchanged."""
    def move(t):
        return torch.empty_like(t, device=device) if t.device.type == "meta" else t.to(device)
    return module._apply(move, recurse=recurse)


def update_use_dist_ckpt(args):
    args.use_dist_ckpt = args.ckpt_format != "torch"


def is_hybrid_model(args):
    """Whether args describe a hybrid (Mamba + attention) model; never here."""
    return getattr(args, "hybrid_layer_pattern", None) is not None


def get_nvtx_range():
    """A context-manager factory that emits NVTX ranges (when profiling with CUDA) around blocks."""
    @contextlib.contextmanager
    def nvtx_range(msg, time=False):
        nvtx_range_push(msg)
        try:
            yield
        finally:
            nvtx_range_pop(msg)
    return nvtx_range


def has_nvrx_installed():
    """Whether NVIDIA resiliency extensions are importable (unused here)."""
    return importlib.util.find_spec("nvidia_resiliency_ext") is not None


def has_nvrx_checkpointing_async_support():
    return False  # async saves run through megatron.core.dist_checkpointing's own AsyncCallsQueue


def is_gtp_remat_active():
    return False  # weight rematerialisation groups are never built here


def append_to_progress_log(save_dir: str, string: str, barrier: bool = True) -> None:
    """Append '<time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world size>\\t<string>' to <save_dir>/progress.txt
    (rank 0 writes, after a barrier unless `barrier` is False); nothing without a save directory."""
    if save_dir is None:
        return
    if barrier and _dist():
        torch.distributed.barrier()
    if get_rank_safe() == 0:
        os.makedirs(save_dir, exist_ok=True)
        with open(os.path.join(save_dir, "progress.txt"), "a+") as f:
            stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            f.write(f"{stamp}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}\t# GPUs: {get_world_size_safe()}\t{string}\n")


def calc_dtensor_params_l2_norm(params):
    """L2 norm of DTensor (FSDP2) params: each local shard's sum of squares, summed over the mesh
    dimensions the tensor is sharded on (replicated dimensions hold the same values)."""
    by_spec = {}
    for p in params:
        by_spec.setdefault((p.device_mesh, tuple(p.placements)), []).append(p.to_local())
    total = 0.0
    for (mesh, placements), locals_ in by_spec.items():
        sq = torch.zeros((), dtype=torch.float32, device=locals_[0].device)
        for t in locals_:
            sq += t.detach().float().pow(2).sum()
        for group, placement in zip(mesh.get_all_groups(), placements):
            if placement.is_shard():
                torch.distributed.all_reduce(sq, group=group)
            elif not placement.is_replicate():
                raise RuntimeError(f"calc_dtensor_params_l2_norm: unsupported placement {placement}")
        total += sq.item()
    return total ** 0.5


def start_memory_history_recording(profiling) -> None:
    """Turn on the CUDA caching allocator's event history (what memory snapshots show as a timeline)
    when `profiling.record_memory_history` is set and this rank is in `profiling.profile_ranks` (all
    ranks when empty). `profiling` is any object with those attributes (Megatron's ProfilingConfig or
    args)."""
    if profiling is None or not getattr(profiling, "record_memory_history", False):
        return
    ranks = getattr(profiling, "profile_ranks", None) or []
    if ranks and get_rank_safe() not in ranks:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("record_memory_history: the allocator history is CUDA's; there is no CUDA device here")
    torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100_000, trace_alloc_record_context=True)
