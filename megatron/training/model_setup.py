"""Build model chunks (one per virtual pipeline stage), wrap them, and create optimizer + LR scheduler."""
import dataclasses
import inspect

import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import TorchFullyShardedDataParallel
from megatron.core.distributed.distributed_data_parallel import buckets_of
from megatron.core.enums import ModelType
from megatron.core.optimizer import get_megatron_optimizer, optimizer_state, tag_params_for_buffer_routing
from megatron.core.optimizer.config_overrides import mup_config_overrides, standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_device, get_model_config
from megatron.training.arguments import ddp_config_from_args, optimizer_config_from_args
from megatron.training.arguments.errors import ArgumentError
from megatron.training.checkpointing import load_checkpoint
from megatron.training.global_vars import get_args, get_timers
from megatron.training.utils import print_rank_0


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True):
    """List of model chunks on this rank: moved to the device, Float16Module for fp16/bf16, then DDP."""
    args = get_args()
    args.model_type = model_type
    model = [_build_chunk(model_provider_func, model_type, vp) for vp in _virtual_stages(args)]
    for chunk in model:
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if parallel_state.get_data_parallel_rank() == 0:
        n = sum(sum(p.nelement() for p in chunk.parameters()) for chunk in model)
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({parallel_state.get_tensor_model_parallel_rank()}, "
              f"{parallel_state.get_pipeline_model_parallel_rank()}): {n}", flush=True)
    device = get_device()
    for chunk in model:
        chunk.to(device)
    if args.fp16 or args.bf16:
        model = [Float16Module(get_model_config(chunk), chunk) for chunk in model]
    if wrap_with_ddp:
        model = _wrap_with_ddp(args, model)
    return model


def _virtual_stages(args):
    vpp = args.virtual_pipeline_model_parallel_size
    return list(range(vpp)) if vpp is not None else [None]


def _build_chunk(model_provider_func, model_type, vp_stage):
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    kwargs = dict(pre_process=pre, post_process=post)
    if "vp_stage" in inspect.signature(model_provider_func).parameters:
        kwargs["vp_stage"] = vp_stage
    elif vp_stage is not None:
        raise ValueError("virtual pipeline stages need a model_provider(pre_process, post_process, vp_stage)")
    chunk = model_provider_func(**kwargs)
    chunk.model_type = model_type
    chunk.vp_stage = vp_stage
    return chunk


def _wrap_with_ddp(args, model):
    ddp_config = ddp_config_from_args(args)
    if ddp_config.num_buckets is not None:  # Megatron's sizing: this rank's params over all its model chunks
        total = sum(p.numel() for chunk in model for p in chunk.parameters())
        ddp_config = dataclasses.replace(ddp_config, bucket_size=buckets_of(total, ddp_config.num_buckets),
                                         num_buckets=None)
    if args.use_torch_fsdp2:
        # Each chunk is its own FSDP2 root; params are broadcast over DP before sharding.
        reshard = args.torch_fsdp2_reshard_after_forward
        return [TorchFullyShardedDataParallel(get_model_config(chunk), ddp_config, chunk, reshard_after_forward=reshard)
                for chunk in model]
    if getattr(args, "use_layer_wise_distributed_optimizer", False):
        tag_params_for_buffer_routing(model)  # Muon's params get DDP buffers whose DP shards hold them whole
    wrapped = [DDP(config=get_model_config(chunk), ddp_config=ddp_config, module=chunk,
                   disable_bucketing=(i > 0)) for i, chunk in enumerate(model)]
    for chunk in wrapped:
        chunk.broadcast_params()  # same starting weights on every DP rank
    return wrapped


def get_optimizer_param_scheduler(optimizer):
    """OptimizerParamScheduler counting samples: iteration-based flags are multiplied by the global batch."""
    args = get_args()
    gbs = args.global_batch_size
    if args.train_samples is None:
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        decay_steps = args.lr_decay_iters * gbs
        wd_incr_steps = args.train_iters * gbs
        wsd_decay_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                        else args.lr_warmup_iters * gbs)
    else:
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        decay_steps = args.lr_decay_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = args.lr_wsd_decay_samples
        warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                        else args.lr_warmup_samples)
    if 0 < decay_steps <= warmup_steps:
        by_iters = args.train_samples is None
        flag = ("--lr-warmup-fraction" if args.lr_warmup_fraction is not None
                else "--lr-warmup-iters" if by_iters else "--lr-warmup-samples")
        horizon = (f"{args.lr_decay_iters} iterations (--lr-decay-iters, by default --train-iters)" if by_iters
                   else f"{args.lr_decay_samples} samples (--lr-decay-samples, by default --train-samples)")
        raise ArgumentError(f"{flag}: the LR warmup must end before the decay horizon of {horizon}; "
                            "shorten the warmup or lengthen the run")
    start_wd = args.start_weight_decay if args.start_weight_decay is not None else args.weight_decay
    end_wd = args.end_weight_decay if args.end_weight_decay is not None else args.weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style,
        start_wd=start_wd, end_wd=end_wd, wd_incr_steps=wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=args.lr_wsd_decay_style)


def _mup_overrides(args, config, model):
    """--use-mup: Megatron's standard param groups plus MuP's per-group LR (and Adam eps) for hidden matrices, from
    the model's width multiplier; None otherwise (the standard groups, built directly)."""
    width_mult = getattr(get_model_config(model[0]), "mup_width_mult", 1.0)
    if not getattr(args, "use_mup", False) or width_mult == 1.0:
        return None
    return {**standard_config_overrides(config), **mup_config_overrides(config, width_mult, config.optimizer)}


def setup_model_and_optimizer(model_provider_func, model_type=ModelType.encoder_or_decoder,
                              no_wd_decay_cond=None, scale_lr_cond=None, lr_mult=1.0):
    """Model chunks, optimizer and scheduler; resumes from --load when given."""
    args = get_args()
    timers = get_timers()
    model = get_model(model_provider_func, model_type)
    config = optimizer_config_from_args(args)
    config.timers = timers  # the optimizer's phase timers (--timing-log-level 1 and up)
    optimizer = get_megatron_optimizer(config, model, no_weight_decay_cond=no_wd_decay_cond,
                                       scale_lr_cond=scale_lr_cond, lr_mult=lr_mult,
                                       config_overrides=_mup_overrides(args, config, model))
    # Adam's moments exist before the first step (zeros, what its first step would create): the first
    # iteration then holds its steady-state memory, so the reported peak after iteration 1 is the run's
    # peak and an out-of-memory shows in the first step, not the second.
    optimizer_state.init_state(optimizer)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    args.iteration, args.num_floating_point_operations_so_far = 0, 0
    if args.load is not None or args.pretrained_checkpoint is not None:
        timers("load-checkpoint", log_level=0).start(barrier=True)
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model, optimizer, opt_param_scheduler)
        timers("load-checkpoint").stop(barrier=True)
        timers.log(["load-checkpoint"])
    return model, optimizer, opt_param_scheduler


def count_global_parameters(model):
    """Parameters of the whole model (all TP/PP ranks; TP-replicated params counted once)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    local = 0.0
    for chunk in model:
        for p in chunk.parameters():
            local += p.numel() if getattr(p, "tensor_model_parallel", False) else p.numel() / tp
    total = torch.tensor([local], dtype=torch.float64, device=get_device())
    torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return int(round(total.item()))


def print_startup_banner(model):
    args = get_args()
    n = count_global_parameters(model)
    tokens = args.global_batch_size * args.seq_length
    print_rank_0(f" > model: {n} parameters ({n / 1e6:.2f}M); tokens per iteration: {tokens} "
                 f"(global batch {args.global_batch_size} x seq length {args.seq_length})")
