"""Turn the flat args namespace into config dataclasses: Megatron Core's (TransformerConfig, OptimizerConfig,
DistributedDataParallelConfig) here, and the 0.19 config-container sections in ``argument_utils``, all
through `config_kwargs_from_args`."""
import dataclasses

import torch
import torch.nn.functional as F

from megatron.core._compat_fields import all_compat_only_fields
from megatron.core.activations import quick_gelu, squared_relu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.fusions.fused_bias_activation import openai_gelu
from megatron.core.optimizer import OptimizerConfig

from .mla_args import mla_config_class, mla_config_overrides


def config_kwargs_from_args(cls, args, **overrides) -> dict:
    """Keyword arguments for the dataclass ``cls``: every field with a same-named arg, then ``overrides``
    (for fields ``cls`` has). Compat-only fields (Megatron's, without a feature here) stay at their
    defaults: their flags are refused upstream."""
    skip = all_compat_only_fields(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kw = {name: getattr(args, name) for name in names if hasattr(args, name) and name not in skip}
    kw.update({k: v for k, v in overrides.items() if k in names})
    return kw


def _require_fields(cls, required):
    """A flag the user set must reach a config field, or we say loudly that it is not wired."""
    field_names = {f.name for f in dataclasses.fields(cls)}
    for flag, (field, active) in required.items():
        if active and field not in field_names:
            raise NotImplementedError(f"{flag} is not supported by this build ({cls.__name__} has no '{field}')")


def core_transformer_config_from_args(args, config_class=None):
    """TransformerConfig from args (Megatron's mapping: same-named fields plus the renamed ones)."""
    if config_class is None:
        config_class = mla_config_class(args)
    overrides = dict(
        persist_layer_norm=not args.no_persist_layer_norm,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        layernorm_epsilon=args.norm_epsilon,
        deallocate_pipeline_outputs=True,
        pipeline_dtype=args.params_dtype,
        batch_p2p_comm=not args.overlap_p2p_comm,
        num_moe_experts=args.num_experts,
        init_method_std=args.init_method_std,
        gated_linear_unit=args.swiglu or args.quick_geglu,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        variable_seq_lengths=False,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
    )
    overrides.update(mla_config_overrides(args))
    if args.swiglu:
        overrides["activation_func"] = F.silu
    elif args.squared_relu:
        overrides["activation_func"] = squared_relu
    elif args.quick_geglu:
        overrides["activation_func"] = quick_gelu
    elif args.openai_gelu:
        overrides["activation_func"] = openai_gelu
    if args.init_method_xavier_uniform:
        overrides["init_method"] = torch.nn.init.xavier_uniform_
        overrides["scaled_init_method"] = torch.nn.init.xavier_uniform_
    kw = config_kwargs_from_args(config_class, args, **overrides)
    _require_fields(config_class, {
        "--qk-layernorm": ("qk_layernorm", args.qk_layernorm),
        "--apply-residual-connection-post-layernorm": ("apply_residual_connection_post_layernorm",
                                                       args.apply_residual_connection_post_layernorm),
        "--add-qkv-bias": ("add_qkv_bias", args.add_qkv_bias and not args.add_bias_linear),
        "--disable-bias-linear": ("add_bias_linear", not args.add_bias_linear),
        "--group-query-attention": ("num_query_groups", args.group_query_attention),
        "--swiglu": ("gated_linear_unit", args.swiglu),
        "--squared-relu / --openai-gelu / --quick-geglu": ("activation_func", args.squared_relu or args.openai_gelu
                                                          or args.quick_geglu),
        "--normalization RMSNorm": ("normalization", args.normalization != "LayerNorm"),
        "--apply-layernorm-1p": ("layernorm_zero_centered_gamma", args.apply_layernorm_1p),
        "--recompute-granularity": ("recompute_granularity", args.recompute_granularity is not None),
        "--sequence-parallel": ("sequence_parallel", args.sequence_parallel),
        "--fp32-residual-connection": ("fp32_residual_connection", args.fp32_residual_connection),
        "--apply-query-key-layer-scaling": ("apply_query_key_layer_scaling", args.apply_query_key_layer_scaling),
        "--rotary-interleaved": ("rotary_interleaved", args.rotary_interleaved),
        "--attention-softmax-in-fp32": ("attention_softmax_in_fp32", args.attention_softmax_in_fp32),
    })
    return config_class(**kw)


def ddp_config_from_args(args, config_class=None):
    """DistributedDataParallelConfig from args."""
    config_class = config_class or DistributedDataParallelConfig
    kw = config_kwargs_from_args(
        config_class, args,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        # Megatron's: --check-for-nan-in-loss-and-grad also checks each bucket's local grads before the reduce.
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
        # The layer-wise optimizer (dist_muon) reduce-scatters grads like the distributed optimizer.
        use_distributed_optimizer=args.use_distributed_optimizer or getattr(
            args, "use_layer_wise_distributed_optimizer", False),
    )
    _require_fields(config_class, {
        "--use-distributed-optimizer": ("use_distributed_optimizer", args.use_distributed_optimizer),
        "--overlap-grad-reduce": ("overlap_grad_reduce", args.overlap_grad_reduce),
        "--overlap-param-gather": ("overlap_param_gather", args.overlap_param_gather),
    })
    return config_class(**kw)


def optimizer_config_from_args(args, config_class=None):
    """OptimizerConfig from args (lr, betas, weight decay, clipping, loss scaling, precision)."""
    config_class = config_class or OptimizerConfig
    kw = config_kwargs_from_args(config_class, args, timers=None)
    _require_fields(config_class, {
        "--use-distributed-optimizer": ("use_distributed_optimizer", args.use_distributed_optimizer),
        "--decoupled-lr": ("decoupled_lr", args.decoupled_lr is not None),
        "--loss-scale": ("loss_scale", args.loss_scale is not None),
    })
    return config_class(**kw)
