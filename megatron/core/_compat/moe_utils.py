"""Megatron Core's ``moe_utils`` names that this project's own MoE code does not call.

Megatron's forms of the permutation (``permute`` / ``unpermute`` / ``sort_chunks_by_idxs``: the
dispatchers use the leaner ``moe_utils._permute`` family), the quantile-balancing assignment step, token
counting and padding helpers, the MoE process groups, and ``track_moe_metrics`` with Megatron's
signature (the log line calls ``moe_logging.track_moe_metrics``). Reached from
``megatron.core.transformer.moe.moe_utils`` through its lazy alias table.
"""
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe import moe_logging
from megatron.core.transformer.moe.moe_utils import _permute_indices, _sort_chunks, moe_layer_pattern


def get_tokens_per_expert_and_token_count(routing_map: torch.Tensor, reduce_group, topk: int = None,
                                          with_padding_mask: bool = False):
    """(tokens per expert summed over ``reduce_group``, local token count, total token count). With a
    padding mask applied to ``routing_map`` the counts come from the routed pairs / topk."""
    local = routing_map.sum(dim=0)
    total_per_expert = reduce_from_tensor_model_parallel_region(local, reduce_group)
    if with_padding_mask:
        return total_per_expert, local.sum() / topk, total_per_expert.sum() / topk
    local_tokens = routing_map.shape[0]
    size = 1 if reduce_group is None else dist.get_world_size(reduce_group)
    return total_per_expert, local_tokens, local_tokens * size


def pad_routing_map(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """Route extra (padding) tokens so every expert's count is a multiple of ``pad_multiple``: in each
    expert's column the first tokens not yet routed to it are added. Modifies and returns the map."""
    per_expert = routing_map.transpose(0, 1)  # a view: [E, T]
    missing = (-per_expert.sum(dim=1)) % pad_multiple
    zero_rank = torch.cumsum((per_expert == 0).int(), dim=1)  # 1-based rank among the unrouted tokens
    per_expert[zero_rank <= missing.unsqueeze(1)] = 1
    return routing_map


def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """A CUDA tensor copied to the host without blocking (a numpy array with ``as_numpy``); anything else
    as is. ``record_stream`` keeps the device memory alive until the current stream has used it."""
    if not (torch.is_tensor(tensor) and tensor.is_cuda):
        return tensor
    host = tensor.to("cpu", non_blocking=True)
    if record_stream:
        tensor.record_stream(torch.cuda.current_stream())
    return host.numpy() if as_numpy else host


def get_align_size_for_quantization(config) -> int:
    """Rows per expert must be a multiple of this for FP8 GEMMs (16; 32 for MXFP8); 0 without FP8."""
    if getattr(config, "use_transformer_engine_op_fuser", False):
        return 256
    if config.fp8:
        return 32 if config.fp8_recipe == "mxfp8" else 16
    if getattr(config, "fp4", None):
        return 32
    return 0


def skip_routed_expert_padding(config) -> bool:
    """Whether the router or a HybridEP/NCCL-EP dispatcher already pads expert inputs for quantization."""
    if getattr(config, "moe_router_padding_for_quantization", False):
        return True
    return config.moe_token_dispatcher_type == "flex" and getattr(
        config, "moe_flex_dispatcher_backend", None) in ("hybridep", "ncclep")


def get_default_pg_collection():
    """The MoE process groups of parallel_state as a ProcessGroupCollection."""
    return ProcessGroupCollection.use_mpu_process_groups(
        ["ep", "tp", "cp", "expt_tp", "expt_dp", "expt_dp_gtp_remat", "tp_ep", "tp_cp", "tp_dp_cp"])


def track_moe_metrics(loss_scale: float, iteration: int, writer=None, wandb_writer=None,
                      total_loss_dict=None, per_layer_logging: bool = False, force_initialize: bool = False,
                      track_names: Optional[List[str]] = None, num_layers: Optional[int] = None,
                      moe_layer_freq: Optional[Union[int, List[int]]] = None,
                      mtp_num_layers: Optional[int] = None, pg_collection=None) -> str:
    """Megatron's entry point: reduce the step's MoE metrics over the ranks (every rank must call it), add
    the losses to ``total_loss_dict``, write TensorBoard/W&B scalars, clear the tracker, and return the
    other metrics as the console string " name: value |". MoE layers: ``moe_layer_freq`` over
    ``num_layers`` plus the ``mtp_num_layers`` MTP layers. Entries missing on a rank are always created
    (so ``force_initialize`` changes nothing); the metrics are reduced over the pp and dp groups of
    ``pg_collection`` (parallel_state's when None)."""
    names = list(track_names or [n for n in moe_logging.get_moe_layer_wise_logging_tracker()
                                 if not n.startswith("_")])
    if num_layers is None:  # every slot of the recorded metrics counts as an MoE layer
        tracker = moe_logging.get_moe_layer_wise_logging_tracker()
        pattern = [1] * max([tracker[n]["values"].numel() for n in names if n in tracker] or [1])
    else:
        pattern = moe_layer_pattern(moe_layer_freq if moe_layer_freq is not None else 1, num_layers)
        pattern = pattern + [1] * (mtp_num_layers or 0)
    losses = {}
    moe_logging.track_moe_metrics(loss_scale, iteration, writer, wandb_writer, losses, per_layer_logging,
                                  names, len(pattern), pattern, pg_collection=pg_collection)
    console = {}
    for name, value in losses.items():
        if total_loss_dict is not None and name.lower().endswith("loss"):
            total_loss_dict[name] = total_loss_dict.get(name, 0.0) + value
        else:
            console[name] = value
    return "".join(f" {k}: {float(v):.2f} |" for k, v in console.items())


def qb_dual_update(scores: torch.Tensor, k: int, beta: torch.Tensor, update_beta: bool = True
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One dual coordinate-descent step of quantile-balancing routing: each of the m tokens picks the k
    experts with the largest ``scores - beta`` ([m, n] scores, [n] per-expert bias), and, with
    ``update_beta``, the new bias is each expert's column quantile of ``scores - alpha`` (alpha: a token's
    (k+1)-th best biased score) that admits m * k / n tokens per expert. Returns (indices [m, k], the new
    bias [n], or ``beta`` unchanged without update_beta). The router's quantile_balancing routing type is
    not implemented here; this is the assignment step for code that routes with it."""
    num_tokens, num_experts = scores.shape
    top = (scores - beta).topk(k + 1, dim=1)
    indices = top.indices[:, :-1]
    if not update_beta:
        return indices, beta
    if (num_tokens * k) % num_experts:
        raise ValueError(f"qb_dual_update: {num_tokens} tokens x top-{k} do not split evenly over "
                         f"{num_experts} experts")
    per_expert = num_tokens * k // num_experts
    alpha = top.values[:, -1:]
    return indices, (scores - alpha).topk(per_expert + 1, dim=0).values[-1].contiguous()


def _padded_flat_index(routing_map, capacity: int):
    """drop_and_pad: every expert holds exactly ``capacity`` tokens; [E * capacity] indices into map.T."""
    num_tokens, num_experts = routing_map.shape
    rows = torch.argsort(routing_map.t().to(torch.int8), dim=-1, descending=True, stable=True)[:, :capacity]
    experts = torch.arange(num_experts, device=routing_map.device).unsqueeze(-1)
    return (experts * num_tokens + rows).reshape(-1)


def permute(tokens, routing_map, probs: Optional[torch.Tensor] = None, num_out_tokens: Optional[int] = None,
            fused: bool = False, drop_and_pad: bool = False, tokens_per_expert: Optional[torch.Tensor] = None,
            align_size: int = 0):
    """Megatron's permute: (permuted tokens [N, h], permuted probs [N] or None, sorted_indices [N] (the
    source token of each row), pad_offsets (None: no padded kernel here), tokens_per_expert as given).

    Rows are expert-major, token order within an expert. ``drop_and_pad``: each column of the map holds
    exactly num_out_tokens / E entries (padded capacity). ``fused`` and ``align_size`` select Transformer
    Engine's permute(-and-pad) kernels in Megatron; here the index path gives the same rows."""
    num_tokens = routing_map.shape[0]
    if drop_and_pad and num_out_tokens is not None:
        flat_index = _padded_flat_index(routing_map, num_out_tokens // routing_map.shape[1])
    else:
        flat_index = _permute_indices(routing_map.bool(), num_out_tokens)
    sorted_indices = flat_index % num_tokens
    permuted_probs = None if probs is None else probs.t().reshape(-1).index_select(0, flat_index)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices, None, tokens_per_expert


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs: Optional[torch.Tensor] = None,
              routing_map: Optional[torch.Tensor] = None, fused: bool = False, drop_and_pad: bool = False,
              pad_offsets: Optional[torch.Tensor] = None):
    """Inverse of `permute`: rows are summed back into their source tokens ([T, h], the input dtype), each
    first weighted by its token's prob when ``probs`` [T, E] is given (needs ``routing_map``). ``fused`` /
    ``pad_offsets`` belong to Transformer Engine's kernels; the result is the same here."""
    dtype = permuted_tokens.dtype
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute: routing_map is required with probs")
        if drop_and_pad:
            # Row r belongs to expert r // capacity: its prob sits at [expert, source token] of probs.T.
            capacity = sorted_indices.numel() // routing_map.shape[1]
            experts = torch.arange(sorted_indices.numel(), device=sorted_indices.device) // capacity
            flat_index = experts * probs.shape[0] + sorted_indices
            permuted_probs = probs.t().reshape(-1).index_select(0, flat_index)
        else:
            permuted_probs = probs.t().contiguous().masked_select(routing_map.t().contiguous().bool())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    return out.index_add(0, sorted_indices, permuted_tokens).to(dtype)


def _host_list(values):
    return values.tolist() if torch.is_tensor(values) else list(values)


def sort_chunks_by_idxs(input: torch.Tensor, split_sizes, sorted_idxs, probs: Optional[torch.Tensor] = None,
                        fused: bool = False):
    """Megatron's form: (reordered input, probs reordered alike or None); sizes and order may be tensors.
    ``fused`` (Transformer Engine's kernel) gives the same result here."""
    sizes, order = _host_list(split_sizes), _host_list(sorted_idxs)
    return _sort_chunks(input, sizes, order), None if probs is None else _sort_chunks(probs, sizes, order)
