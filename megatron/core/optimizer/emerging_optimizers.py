"""Build Muon for `get_megatron_optimizer` (Megatron 0.19's emerging-optimizer path, Muon only).

The param groups are split by `uses_muon`: Muon (TensorParallelMuon) takes the 2-D hidden weights, AdamW the
rest, each wrapped like Adam (fp32 main params for bf16 models) and chained so that both step together
with one global grad norm and clip. With the layer-wise distributed optimizer (`dist_muon`) both parts are
DistributedOptimizers over the same DDP: Muon's over the layer-wise buffers (each DP rank updates whole
matrices, then the bucket all-gather shares them), AdamW's over the others (1/DP of each bucket).
"""
from typing import Callable, Dict, List

import torch

from megatron.core import parallel_state
from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.layer_wise_optimizer import tag_qkv_params, uses_muon
from megatron.core.optimizer.muon import TensorParallelMuon
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig


def split_muon_param_groups(param_groups: List[Dict]):
    """(Muon groups, AdamW groups): each group's params split by `uses_muon`, its settings kept; a part
    with no params is dropped (each optimizer keeps one group so that both always exist)."""
    muon, adam = [], []
    for group in param_groups:
        for target, keep in ((muon, True), (adam, False)):
            params = [p for p in group["params"] if uses_muon(p) == keep]
            if params:
                target.append({**group, "params": params})
    template = dict(param_groups[0]) if param_groups else {}
    for target in (muon, adam):
        if not target:
            target.append({**template, "params": []})
    return muon, adam


def muon_from_config(config: OptimizerConfig, param_groups: List[Dict]) -> TensorParallelMuon:
    return TensorParallelMuon(
        param_groups, lr=config.lr, momentum=config.muon_momentum, nesterov=config.muon_nesterov,
        weight_decay=config.weight_decay, split_qkv=config.muon_split_qkv,
        fp32_matmul_prec=config.muon_fp32_matmul_prec, coefficient_type=config.muon_coefficient_type,
        num_ns_steps=config.muon_num_ns_steps, scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor, tp_mode=config.muon_tp_mode,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        expert_tp_group=parallel_state.get_expert_tensor_parallel_group(check_initialized=False))


def get_megatron_muon_optimizer(config: OptimizerConfig, model_chunks, param_groups: List[Dict],
                                adam_factory: Callable, grad_scaler=None) -> ChainedOptimizer:
    """ChainedOptimizer([Muon part, AdamW part]); ``adam_factory(param_groups)`` builds the inner AdamW."""
    # Megatron 0.19: dist_muon, and muon with --use-distributed-optimizer, are the layer-wise optimizer.
    layer_wise = (config.use_layer_wise_distributed_optimizer or config.optimizer == "dist_muon"
                  or config.use_distributed_optimizer)
    tag_qkv_params(model_chunks)
    muon_groups, adam_groups = split_muon_param_groups(param_groups)
    muon_inner, adam_inner = muon_from_config(config, muon_groups), adam_factory(adam_groups)
    if layer_wise:
        parts = _layer_wise_parts(config, model_chunks, muon_inner, adam_inner, grad_scaler)
    else:
        low_precision = config.bf16 or any(p.dtype != torch.float32 for g in param_groups for p in g["params"])
        wrap = Float16OptimizerWithFloat16Params if low_precision else FP32Optimizer
        parts = [wrap(inner, config, grad_scaler=grad_scaler) for inner in (muon_inner, adam_inner)]
    return ChainedOptimizer(parts)


def _layer_wise_parts(config, model_chunks, muon_inner, adam_inner, grad_scaler) -> List[DistributedOptimizer]:
    for chunk in model_chunks:
        if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False):
            raise ValueError("--optimizer dist_muon needs the model in DistributedDataParallel with "
                             "use_distributed_optimizer=True and tag_params_for_buffer_routing() run before it")
    muon_buffers, adam_buffers = _split_buffers(model_chunks)
    return [DistributedOptimizer(muon_inner, config, grad_scaler, None, model_chunks, per_model_buffers=muon_buffers,
                                 whole_params=True),
            DistributedOptimizer(adam_inner, config, grad_scaler, None, model_chunks, per_model_buffers=adam_buffers)]


def _split_buffers(model_chunks):
    """({chunk index: layer-wise buffers}, {chunk index: the other buffers}); a Muon param found in a default
    buffer means the params were not tagged before DDP was built."""
    muon: Dict[int, list] = {}
    adam: Dict[int, list] = {}
    for i, chunk in enumerate(model_chunks):
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            tagged = [bool(getattr(p, "is_managed_by_layer_wise_optimizer", False)) for p in buffer.params]
            if any(tagged) and not all(tagged):
                raise ValueError("a DDP buffer mixes Muon and AdamW params; run tag_params_for_buffer_routing() "
                                 "on the model chunks before wrapping them in DistributedDataParallel")
            untagged_muon = not any(tagged) and any(uses_muon(p) for p in buffer.params)
            if untagged_muon:
                raise ValueError("--optimizer dist_muon: the Muon params were not tagged before DDP was built; "
                                 "run tag_params_for_buffer_routing(model_chunks) before DistributedDataParallel")
            (muon if any(tagged) else adam).setdefault(i, []).append(buffer)
    return muon, adam


def is_muon(config: OptimizerConfig) -> bool:
    return config.optimizer in ("muon", "dist_muon")

