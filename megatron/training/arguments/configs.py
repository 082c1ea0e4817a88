"""Turn the flat args namespace into Megatron Core's config dataclasses."""
import dataclasses

import torch
import torch.nn.functional as F


def _copy_matching_fields(cls, args, **overrides):
    """Fill every dataclass field that has a same-named arg; overrides win. Compat-only fields
    (Megatron's, without a feature here) stay at their defaults: their flags are refused upstream."""
    from megatron.core._compat_fields import all_compat_only_fields
    skip = all_compat_only_fields(cls)
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
          if hasattr(args, f.name) and f.name not in skip}
    field_names = {f.name for f in dataclasses.fields(cls)}
    kw.update({k: v for k, v in overrides.items() if k in field_names})
    return kw, field_names


def _require_fields(cls_name, field_names, required):
    """A flag the user set must reach a config field, or we say loudly that it is not wired."""
    for flag, (field, active) in required.items():
        if active and field not in field_names:
            raise NotImplementedError(f"{flag} is not supported by this build ({cls_name} has no '{field}')")


def core_transformer_config_from_args(args, config_class=None):
    """TransformerConfig from args (Megatron's mapping: same-named fields plus the renamed ones)."""
    from .mla_args import mla_config_class, mla_config_overrides
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
        gated_linear_unit=args.swiglu,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        variable_seq_lengths=False,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
    )
    overrides.update(mla_config_overrides(args))
    if args.swiglu:
        overrides["activation_func"] = F.silu
    elif args.squared_relu:
        overrides["activation_func"] = lambda x: torch.pow(F.relu(x), 2)
    elif args.openai_gelu:
        from megatron.core.fusions.fused_bias_activation import openai_gelu
        overrides["activation_func"] = openai_gelu
    if args.init_method_xavier_uniform:
        overrides["init_method"] = torch.nn.init.xavier_uniform_
        overrides["scaled_init_method"] = torch.nn.init.xavier_uniform_
    kw, names = _copy_matching_fields(config_class, args, **overrides)
    _require_fields(config_class.__name__, names, {
        "--qk-layernorm": ("qk_layernorm", args.qk_layernorm),
        "--apply-residual-connection-post-layernorm": ("apply_residual_connection_post_layernorm",
                                                       args.apply_residual_connection_post_layernorm),
        "--add-qkv-bias": ("add_qkv_bias", args.add_qkv_bias and not args.add_bias_linear),
        "--disable-bias-linear": ("add_bias_linear", not args.add_bias_linear),
        "--group-query-attention": ("num_query_groups", args.group_query_attention),
        "--swiglu": ("gated_linear_unit", args.swiglu),
        "--squared-relu / --openai-gelu": ("activation_func", args.squared_relu or args.openai_gelu),
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
    if config_class is None:
        from megatron.core.distributed import DistributedDataParallelConfig as config_class
    kw, names = _copy_matching_fields(
        config_class, args,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )
    _require_fields(config_class.__name__, names, {
        "--use-distributed-optimizer": ("use_distributed_optimizer", args.use_distributed_optimizer),
        "--overlap-grad-reduce": ("overlap_grad_reduce", args.overlap_grad_reduce),
        "--overlap-param-gather": ("overlap_param_gather", args.overlap_param_gather),
    })
    return config_class(**kw)


def optimizer_config_from_args(args, config_class=None):
    """OptimizerConfig from args (lr, betas, weight decay, clipping, loss scaling, precision)."""
    if config_class is None:
        from megatron.core.optimizer import OptimizerConfig as config_class
    kw, names = _copy_matching_fields(config_class, args, timers=None)
    _require_fields(config_class.__name__, names, {
        "--use-distributed-optimizer": ("use_distributed_optimizer", args.use_distributed_optimizer),
        "--decoupled-lr": ("decoupled_lr", args.decoupled_lr is not None),
        "--loss-scale": ("loss_scale", args.loss_scale is not None),
    })
    return config_class(**kw)
