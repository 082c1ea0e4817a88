"""Megatron's smaller MoE helpers (re-exported by moe_utils under their Megatron import path): router
gating in the router dtype, random routing for load-balanced benchmarks, the expert-bias update, token
counts, process groups and the MoE log string."""
from typing import List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker, get_data_parallel_rng_tracker_name, get_expert_parallel_rng_tracker_name)


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
    from megatron.core.process_groups_config import ProcessGroupCollection
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
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.moe_utils import moe_layer_pattern
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
