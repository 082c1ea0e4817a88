"""Optimizers: param groups, mixed precision with fp32 main params, loss scaling, clipping, and the
distributed (sharded-state) optimizer. Entry point: `get_megatron_optimizer`."""
from typing import Callable, Dict, List, Optional

import torch

from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.config_overrides import (
    check_config_overrides_consistency,
    default_no_weight_decay,
    param_groups_from_overrides,
    trainable_named_parameters,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.emerging_optimizers import get_megatron_muon_optimizer, is_muon
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.layer_wise_optimizer import (
    is_managed_by_layer_wise_optimizer,
    tag_params_for_buffer_routing,
)
from megatron.core.optimizer.lion import Lion
from megatron.core.optimizer.muon import TensorParallelMuon
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    param_group_identifier_keys,
)
from megatron.core.optimizer.optimizer_config import (
    AdamOptimizerConfig,
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    SGDOptimizerConfig,
)
from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW
from megatron.core.utils import lazy_names

# Megatron's names that this package's own code does not call (the _compat room), resolved on first use.
__getattr__ = lazy_names(__name__, {
    "clip_grad_norm_fp32": "megatron.core._compat.clip_grads", "count_zeros_fp32": "megatron.core._compat.clip_grads",
    "get_standard_config_overrides": "megatron.core._compat.optimizer",
    "get_mup_config_overrides": "megatron.core._compat.optimizer",
    "HAVE_EMERGING_OPTIMIZERS": "megatron.core._compat.optimizer",
})


def _is_embedding_or_output(name: str, param) -> bool:
    if getattr(param, "is_embedding_or_output_parameter", False) or getattr(param, "shared_embedding", False):
        return True
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")


def _get_param_groups(model_chunks, config: OptimizerConfig, no_weight_decay_cond, scale_lr_cond,
                      lr_mult: float) -> List[Dict]:
    """Group params by (wd_mult, lr_mult, expert, decoupled LR); each group carries its own
    max_lr/min_lr/wd_mult/lr_mult for the LR scheduler. Weight decay by `default_no_weight_decay` unless the
    caller passes its own ``no_weight_decay_cond``."""
    groups: Dict[tuple, List] = {}
    for name, param in trainable_named_parameters(model_chunks):
        if no_weight_decay_cond is not None:
            no_wd = no_weight_decay_cond(name, param)
        else:
            no_wd = default_no_weight_decay(name, param, config.apply_wd_to_qk_layernorm)
        scale_lr = scale_lr_cond(name, param) if scale_lr_cond is not None else False
        wd_mult = 0.0 if no_wd else 1.0
        group_lr_mult = lr_mult if scale_lr else 1.0
        expert = not getattr(param, "allreduce", True)
        decoupled = config.decoupled_lr is not None and _is_embedding_or_output(name, param)
        groups.setdefault((wd_mult, group_lr_mult, expert, decoupled), []).append(param)
    out = []
    for (wd_mult, group_lr_mult, expert, decoupled), params in groups.items():
        max_lr = config.decoupled_lr if decoupled else config.lr
        min_lr = config.min_lr
        if decoupled and config.decoupled_min_lr is not None:
            min_lr = config.decoupled_min_lr
        out.append({"params": params, "wd_mult": wd_mult, "lr_mult": group_lr_mult,
                    "default_config": not decoupled and group_lr_mult == 1.0,
                    "is_expert_parallel": expert, "is_decoupled_lr": decoupled,
                    "max_lr": max_lr, "min_lr": min_lr if min_lr is not None else 0.0,
                    "lr": (max_lr or 0.0) * group_lr_mult, "weight_decay": config.weight_decay * wd_mult})
    return out


def _inner_optimizer(config: OptimizerConfig, param_groups, optimizer: Optional[str] = None):
    lr = config.lr if config.lr is not None else 0.0
    on_cuda = all(p.is_cuda for g in param_groups for p in g["params"])
    if (optimizer or config.optimizer) == "adam" and config.use_precision_aware_optimizer:
        return PrecisionAwareAdamW(param_groups, lr=lr, weight_decay=config.weight_decay,
                                   betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                   exp_avg_dtype=config.exp_avg_dtype, exp_avg_sq_dtype=config.exp_avg_sq_dtype)
    if (optimizer or config.optimizer) == "adam":
        # AdamW semantics (decoupled weight decay), as Megatron's fused Adam with adam_w_mode.
        kwargs = {"fused": True} if on_cuda else {"foreach": False}
        return torch.optim.AdamW(param_groups, lr=lr, weight_decay=config.weight_decay,
                                 betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, **kwargs)
    if (optimizer or config.optimizer) == "lion":
        return Lion(param_groups, lr=lr, betas=(config.lion_beta1, config.lion_beta2), weight_decay=config.weight_decay)
    kwargs = {"foreach": True} if on_cuda else {"foreach": False}
    return torch.optim.SGD(param_groups, lr=lr, weight_decay=config.weight_decay,
                           momentum=config.sgd_momentum, **kwargs)


def _grad_scaler(config: OptimizerConfig) -> Optional[MegatronGradScaler]:
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=int(config.loss_scale_window), hysteresis=config.hysteresis)
    return None


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: List[torch.nn.Module],
                           config_overrides: Optional[Dict] = None, use_gloo_process_groups: bool = True,
                           pg_collection=None, dump_param_to_param_group_map: Optional[str] = None, *,
                           no_weight_decay_cond: Optional[Callable] = None,
                           scale_lr_cond: Optional[Callable] = None, lr_mult: float = 1.0) -> MegatronOptimizer:
    """Build the optimizer for `model_chunks` (DDP-wrapped for the distributed optimizer).

    Per-parameter settings: Megatron 0.19's `config_overrides` (ParamKey -> ParamGroupOverride; start
    from get_standard_config_overrides(config) to keep the default no-weight-decay and decoupled-LR
    rules), or the keyword-only `no_weight_decay_cond(name, param)`, `scale_lr_cond(name, param)` and
    `lr_mult` (Megatron's pre-0.16 interface); with neither, the standard rules apply. Explicit process
    groups and the param-group dump are refused; `use_gloo_process_groups` has no effect (the groups
    come from parallel_state)."""
    refused = dict(pg_collection=pg_collection, dump_param_to_param_group_map=dump_param_to_param_group_map)
    for name, value in refused.items():
        if value is not None:
            raise NotImplementedError(f"get_megatron_optimizer({name}=...) is not supported; leave it None")
    legacy = no_weight_decay_cond is not None or scale_lr_cond is not None or lr_mult != 1.0
    if config_overrides is not None and legacy:
        raise ValueError("get_megatron_optimizer: pass config_overrides or no_weight_decay_cond / scale_lr_cond "
                         "/ lr_mult, not both")
    check_config_overrides_consistency(config, config_overrides)
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr (--lr) must be set")
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    _refuse_explicit_group_models(model_chunks)
    if config_overrides is not None:
        param_groups = param_groups_from_overrides(model_chunks, config, config_overrides)
    else:
        param_groups = _get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult)
    scaler = _grad_scaler(config)
    if is_muon(config):
        opt = get_megatron_muon_optimizer(config, model_chunks, param_groups,
                                          lambda groups: _inner_optimizer(config, groups, config.muon_scalar_optimizer),
                                          scaler)
        for part in opt.chained_optimizers:
            part.has_expert_params = _is_moe(model_chunks)
        return opt
    inner = _inner_optimizer(config, param_groups)
    if config.use_distributed_optimizer and not _sharding_decided_by_strategy(model_chunks):
        opt = DistributedOptimizer(inner, config, scaler, None, list(model_chunks))
    elif config.use_precision_aware_optimizer:
        raise ValueError("--use-precision-aware-optimizer keeps the distributed optimizer's state in 16 bits; these "
                         "model chunks are sharded by their FSDP strategy (--data-parallel-sharding-strategy "
                         "optim, or DDP, runs the distributed optimizer)")
    elif config.fp16 or config.bf16 or any(p.dtype != torch.float32 for g in param_groups for p in g["params"]):
        opt = Float16OptimizerWithFloat16Params(inner, config, scaler)
    else:
        opt = FP32Optimizer(inner, config, grad_scaler=scaler)
    opt.has_expert_params = _is_moe(model_chunks)
    return opt


def _refuse_explicit_group_models(model_chunks) -> None:
    """The grad norm, clipping and the distributed optimizer's shards read parallel_state's groups, so a
    model (or its DDP wrapper) built on an explicit pg_collection is refused in one line rather than
    clipped with another model's norm."""
    for chunk in model_chunks:
        while chunk is not None:
            if getattr(chunk, "pg_collection", None) is not None:
                raise NotImplementedError("get_megatron_optimizer: a model chunk was built on an explicit "
                                          "pg_collection; the optimizer's grad norm and sharding read "
                                          "parallel_state's groups (use a torch optimizer on its main grads)")
            chunk = getattr(chunk, "module", None)


def _sharding_decided_by_strategy(model_chunks) -> bool:
    """Chunks from FullyShardedDataParallel whose sharding strategy is not `optim`: as with Megatron-FSDP,
    the strategy decides what is sharded, and use_distributed_optimizer adds no ZeRO-1 optimizer."""
    return all(getattr(chunk, "data_parallel_sharding_strategy", "optim") != "optim" for chunk in model_chunks)


def _is_moe(model_chunks) -> bool:
    """From the model config, not the local params: a pipeline stage without MoE layers must still join
    the expert grad-norm reduction."""
    for chunk in model_chunks:
        while not hasattr(chunk, "config") and hasattr(chunk, "module"):
            chunk = chunk.module
        if getattr(getattr(chunk, "config", None), "num_moe_experts", None):
            return True
    return False


__all__ = [
    "OptimizerConfig", "get_megatron_optimizer", "MegatronOptimizer", "FP32Optimizer",
    "Float16OptimizerWithFloat16Params", "DistributedOptimizer", "ChainedOptimizer", "ConstantGradScaler",
    "DynamicGradScaler", "MegatronGradScaler", "clip_grad_norm_fp32", "count_zeros_fp32", "get_grad_norm_fp32",
    "get_standard_config_overrides", "get_mup_config_overrides", "check_config_overrides_consistency",
    "param_group_identifier_keys", "TensorParallelMuon", "is_managed_by_layer_wise_optimizer",
    "tag_params_for_buffer_routing",
]
