"""Per-layer MoE metrics (balancing losses, z-loss, expert load) recorded during the step and reduced
across ranks for the log line, with Megatron's tracker function names.

Each name holds a [num_layers] tensor summed over the step's micro-batches. At log time the values are
summed over the pipeline (each stage fills its own layers) and over the loss's own reduce group (e.g. the
TP ranks that split the tokens), averaged over data parallel, and scaled by 1 / micro-batches.
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import get_pg, get_pg_size

_TRACKER: Dict[str, dict] = {}


def save_to_aux_losses_tracker(name: str, loss: torch.Tensor, layer_number: int, num_layers: int,
                               reduce_group=None, avg_group=None, reduce_group_has_dp: bool = False):
    """Add ``loss`` (detached) to layer ``layer_number`` (1-based) of metric ``name``."""
    if layer_number is None:
        return
    entry = _TRACKER.get(name)
    if entry is None or entry["values"].device != loss.device:
        entry = _TRACKER[name] = {"values": torch.zeros(num_layers, device=loss.device)}
    elif entry["values"].numel() < num_layers:  # MTP layers' slots follow the decoder's: grow, keep values
        entry["values"] = torch.cat([entry["values"], entry["values"].new_zeros(num_layers - entry["values"].numel())])
    entry["values"][layer_number - 1] += loss.detach().float().reshape(())
    entry.update(reduce_group=reduce_group, avg_group=avg_group, reduce_group_has_dp=reduce_group_has_dp)


def save_expert_load(tokens_per_expert: torch.Tensor, layer_number: int, num_layers: int, reduce_group=None):
    """Record this micro-batch's tokens per expert of one layer (for the max/min load in the log).

    Added in place into one tensor per layer that lives across steps (cleared in place), like the losses'
    values: a whole-iteration CUDA graph replays the addition into the tensor it captured, without the Python
    that would otherwise rebind it, and the log reads that tensor."""
    if layer_number is None:
        return
    entry = _TRACKER.setdefault("_expert_load", {"counts": {}})
    counts = entry["counts"]
    t = tokens_per_expert.detach()
    previous = counts.get(layer_number)
    if previous is None or previous.shape != t.shape or previous.device != t.device:
        counts[layer_number] = t.float().clone()  # another model (a different expert count) replaces it
    else:
        previous += t
    entry["reduce_group"] = reduce_group


def clear_aux_losses_tracker():
    for entry in _TRACKER.values():
        if "values" in entry:
            entry["values"].zero_()
        for counts in entry.get("counts", {}).values():
            counts.zero_()


def get_moe_layer_wise_logging_tracker():
    return _TRACKER


def _reduce(t, group, op=dist.ReduceOp.SUM):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _pp_and_dp_groups(pg_collection):
    """The pipeline and data-parallel groups the metrics are reduced over: an explicit collection's pp
    and dp groups, else parallel_state's."""
    if pg_collection is None:
        return (parallel_state.get_pipeline_model_parallel_group(),
                parallel_state.get_data_parallel_group(with_context_parallel=False))
    return get_pg(pg_collection, "pp", "MoE metrics"), get_pg(pg_collection, "dp", "MoE metrics")


def reduce_aux_losses_tracker_across_ranks(track_names: Optional[List[str]] = None, pg_collection=None):
    """Sum each metric over PP and its reduce group, then average over DP (or its avg group); the pp and
    dp groups of ``pg_collection`` when given."""
    pp_group, dp_group = _pp_and_dp_groups(pg_collection)
    names = track_names if track_names is not None else [n for n in _TRACKER if not n.startswith("_")]
    for name in names:
        entry = _TRACKER[name]
        values = entry["values"]
        _reduce(values, pp_group)
        _reduce(values, entry.get("reduce_group"))
        group = entry.get("avg_group")
        if group is None and not entry.get("reduce_group_has_dp"):
            group = dp_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
            values /= dist.get_world_size(group)


def _expert_load_summary(num_layers: int, pg_collection=None, ep_size: int = 1):
    """Device tensor [max load, min load, max rank load], each the mean over MoE layers: an expert's tokens
    over the mean tokens per expert, counted over all ranks of the step (1.0 = perfectly balanced); and with
    expert parallelism (``ep_size`` > 1, experts in contiguous blocks per EP rank) the busiest EP rank's
    tokens over the mean per rank, the factor by which that rank's expert GEMMs outlast the others' while
    they wait for it in the combine all-to-all (0 without EP)."""
    entry = _TRACKER.get("_expert_load")
    pp_group, dp_group = _pp_and_dp_groups(pg_collection)
    ratios = torch.zeros(3, device=_device())
    layers = torch.zeros(1, device=_device())
    if entry is not None:
        for counts in entry["counts"].values():
            counts = _reduce(counts.clone(), entry.get("reduce_group"))
            counts = _reduce(counts, dp_group)
            mean = counts.mean().clamp(min=1e-9)
            rank = torch.zeros((), device=counts.device)
            if ep_size > 1 and counts.numel() % ep_size == 0:
                per_rank = counts.view(ep_size, -1).sum(1)
                rank = per_rank.max() / per_rank.mean().clamp(min=1e-9)
            # A layer that routed nothing since the last clear (another model's slot) does not count.
            routed = (counts.sum() > 0).float().to(ratios.device)
            ratios += routed * torch.stack([counts.max() / mean, counts.min() / mean, rank]).to(ratios.device)
            layers += routed
    both = _reduce(torch.cat([ratios, layers]), pp_group)
    return both[:3] / both[3].clamp(min=1)


def _ep_size(pg_collection) -> int:
    """Expert-parallel ranks; 1 where the groups are not set up (a metrics call outside training)."""
    try:
        return get_pg_size(pg_collection, "ep", "MoE metrics")
    except (AssertionError, AttributeError, RuntimeError, ValueError):
        return 1


def _device():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def track_moe_metrics(loss_scale: float, iteration: int, writer=None, wandb_writer=None,
                      total_loss_dict=None, per_layer_logging: bool = False, track_names=None,
                      num_layers: Optional[int] = None, moe_layer_pattern=None, log_expert_load: bool = True,
                      pg_collection=None):
    """Reduce this step's MoE metrics, add each name's mean over MoE layers to ``total_loss_dict`` (the
    log line), write TensorBoard/W&B scalars (per layer with ``per_layer_logging``), and clear them.
    Every rank must call it (it runs collectives; over the pp and dp groups of ``pg_collection`` when
    given). Values stay on the device (no host sync) unless scalars are written."""
    track_names = list(track_names or [])
    for name in track_names:
        if name not in _TRACKER:  # a stage without this loss still joins the reductions
            _TRACKER[name] = {"values": torch.zeros(num_layers, device=_device()), "reduce_group": None,
                              "avg_group": None, "reduce_group_has_dp": False}
        if name.startswith("global"):
            _TRACKER[name]["reduce_group_has_dp"] = True
    reduce_aux_losses_tracker_across_ranks(track_names, pg_collection)
    pattern = moe_layer_pattern or [1] * num_layers
    num_moe = max(1, sum(pattern))
    scalars = {}
    for name in track_names:
        values = _TRACKER[name]["values"].float() * loss_scale
        mean = values.sum() / num_moe
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, 0.0) + mean
        scalars[name] = mean
        if per_layer_logging:
            for i in range(num_layers):
                if pattern[i]:
                    scalars[f"moe/{name}_layer_{i}"] = values[i]
    if log_expert_load:
        ep_size = _ep_size(pg_collection)
        load = _expert_load_summary(num_layers, pg_collection, ep_size)
        if total_loss_dict is not None:
            total_loss_dict["moe max load"] = total_loss_dict.get("moe max load", 0.0) + load[0]
            total_loss_dict["moe min load"] = total_loss_dict.get("moe min load", 0.0) + load[1]
            if ep_size > 1:
                total_loss_dict["moe max rank load"] = total_loss_dict.get("moe max rank load", 0.0) + load[2]
        scalars["moe/max_load"], scalars["moe/min_load"] = load[0], load[1]
        if ep_size > 1:
            scalars["moe/max_rank_load"] = load[2]
    if writer is not None or wandb_writer is not None:
        scalars = {key: float(value) for key, value in scalars.items()}
        for key, value in scalars.items():
            if writer is not None:
                writer.add_scalar(key, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log(scalars, iteration)
    clear_aux_losses_tracker()
    return scalars
