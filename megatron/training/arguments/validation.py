"""validate_args: derive defaults and reject bad configurations with one line naming the flag and the fix."""
import os
import signal
import warnings
from types import SimpleNamespace

import torch

from megatron.core.nccl_group_options import nccl_group_configs
from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator
from megatron.core.transformer.activation_offload import check_offloading
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_block import layers_per_pipeline_rank

from .autoresume_args import validate_autoresume_args
from .context_parallel_args import validate_context_parallel_args
from .diagnostics_args import validate_diagnostics_args
from .dropin_args import validate_dropin_args
from .errors import ArgumentError
from .errors import require as _require
from .fast_path import validate_fast_path_args
from .fim_args import validate_fim_args
from .health_args import validate_health_args
from .hybrid_args import hybrid_pipeline_placed_by_pattern, validate_hybrid_args
from .inference_args import validate_inference_args
from .input_checks import blend_prefixes_checked, reads_image_text_data, validate_inputs
from .megatron_flags import check_megatron_flags
from .mla_args import validate_mla_args
from .modelopt_args import report_modelopt_args
from .moe_args import validate_moe_args
from .mup_args import validate_mup_args
from .optimizer_args import validate_optimizer_args
from .precision_aware_args import validate_precision_aware_args
from .profiling_args import validate_profiling_args
from .qk_clip_args import validate_qk_clip_args
from .sft_args import validate_sft_args
from .spec_args import validate_spec_args
from .tp_overlap_args import validate_tp_overlap_args
from .validation_set_args import validate_validation_set_args
from .window_args import validate_window_args


def _warn(args, message):
    if args.rank == 0:
        warnings.warn(message)


def validate_args(args, defaults={}):
    """Check flags, fill derived values (data-parallel size, dtype, ffn size...) and return args."""
    defaults = defaults or {}
    check_megatron_flags(args)
    _apply_defaults(args, defaults)
    validate_hybrid_args(args, _require)
    validate_dropin_args(args, _require, lambda m: print(m, flush=True) if args.rank == 0 else None)
    validate_optimizer_args(args, _require, _warn)
    validate_precision_aware_args(args, _require)
    _validate_parallel(args)
    _validate_batch(args)
    _validate_model(args)
    _validate_offloading(args)
    _validate_logging_intervals(args)
    _validate_non_persistent_checkpoints(args)
    validate_window_args(args, _require)
    validate_spec_args(args, _require)
    validate_mup_args(args, _require)
    report_modelopt_args(args, lambda m: print(m, flush=True) if args.rank == 0 else None)
    validate_validation_set_args(args, _require)
    validate_tp_overlap_args(args, _require, lambda m: print(m, flush=True))
    validate_moe_args(args, _require)
    validate_fast_path_args(args, _require, lambda m: print(m, flush=True))
    validate_qk_clip_args(args, _require)
    validate_context_parallel_args(args, _require, _warn)
    validate_mla_args(args, _require)
    _validate_precision(args)
    _validate_run_length(args)
    _validate_checkpointing(args)
    _validate_data(args)
    _validate_tokenizer(args)
    validate_sft_args(args, _require)
    validate_fim_args(args, _require)
    _validate_misc(args)
    validate_inference_args(args, _require)
    validate_diagnostics_args(args, _require)
    validate_health_args(args, _require)
    validate_profiling_args(args, _require)
    validate_autoresume_args(args, _require)
    validate_inputs(args, _require)
    return args


def _apply_defaults(args, defaults):
    """Entry-point defaults apply only to flags the user left unset (None)."""
    for key, value in defaults.items():
        current = getattr(args, key, None)
        if current is None:
            setattr(args, key, value)
        elif current != value and args.rank == 0:
            print(f"WARNING: overriding default arguments for {key}:{value} with {key}:{current}", flush=True)


def _validate_parallel(args):
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--expert-model-parallel-size",
                                                          args.expert_model_parallel_size)):
        _require(value >= 1, f"{flag} ({value}) must be >= 1")
    model_parallel = tp * pp * cp
    _require(args.world_size % model_parallel == 0,
             f"world size ({args.world_size}) must be divisible by --tensor-model-parallel-size ({tp}) x "
             f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp})")
    args.data_parallel_size = args.world_size // model_parallel
    if args.rank == 0:
        hcp = args.hierarchical_context_parallel_sizes
        print(f"using world size: {args.world_size}, data-parallel size: {args.data_parallel_size}, "
              f"context-parallel size: {cp}, hierarchical context-parallel sizes: {hcp}, "
              f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: {pp}", flush=True)
    if args.sequence_parallel and tp == 1:
        _warn(args, "disabling --sequence-parallel since --tensor-model-parallel-size is 1")
        args.sequence_parallel = False
    _validate_virtual_pipeline(args)
    _validate_microbatch_group(args)
    if args.overlap_param_gather:
        _require((args.use_distributed_optimizer or args.use_layer_wise_distributed_optimizer)
                 and args.overlap_grad_reduce,
                 "--overlap-param-gather requires --use-distributed-optimizer and --overlap-grad-reduce")
    if args.use_torch_fsdp2:
        _require(pp == 1, "--use-torch-fsdp2 does not support --pipeline-model-parallel-size > 1; "
                          "use DDP (optionally --use-distributed-optimizer) with pipeline parallelism")
        _require(not args.use_distributed_optimizer,
                 "--use-torch-fsdp2 already shards optimizer state; drop --use-distributed-optimizer")
        _require(args.ddp_num_buckets is None, "--ddp-num-buckets sizes DDP's gradient buckets; --use-torch-fsdp2 "
                                               "reduces per FSDP unit and has none: drop it")
    _validate_optimizer_instances(args)
    _require(args.ddp_num_buckets is None or args.ddp_bucket_size is None,
             "--ddp-num-buckets and --ddp-bucket-size both size the buckets; pass one")
    _require(args.ddp_num_buckets is None or args.ddp_num_buckets > 0,
             f"--ddp-num-buckets ({args.ddp_num_buckets}) must be > 0")
    if not torch.cuda.is_available() and args.distributed_backend == "nccl":
        args.distributed_backend = "gloo"  # NCCL needs CUDA; gloo is the CPU backend
    try:  # unknown groups, keys or an unreadable file: one line now, not at process-group creation
        nccl_group_configs(args.nccl_communicator_config_path, args.high_priority_stream_groups,
                           nccl=args.distributed_backend == "nccl")
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def _validate_step_schedule(args):
    """--step-batch-size-schedule: parsed as the calculator will (thresholds in tokens), one line if it cannot be.
    Its last batch size becomes --global-batch-size, which Megatron ignores beside a schedule. An earlier size need
    not divide by micro-batch x DP (a resumed run may have more GPUs than when it passed that stretch); the batch
    size in force is checked at every step."""
    _require(args.rampup_batch_size is None, "--step-batch-size-schedule and --rampup-batch-size both set the batch "
                                             "size over training; pass one")
    _require(not args.decrease_batch_size_if_needed,
             "--step-batch-size-schedule sets exact batch sizes: drop --decrease-batch-size-if-needed")
    try:
        schedule = StepBatchsizeNumMicroBatchesCalculator._parse_schedule(
            args.step_batch_size_schedule, args.seq_length or getattr(args, "encoder_seq_length", None))
    except ValueError as e:
        raise ArgumentError(f"{e} (--step-batch-size-schedule {args.step_batch_size_schedule!r})") from None
    final = schedule[-1][1]
    if args.global_batch_size not in (None, final):
        _warn(args, f"--global-batch-size ({args.global_batch_size}) is replaced by the last batch size of "
                    f"--step-batch-size-schedule ({final})")
    args.global_batch_size = final
    per_step = args.micro_batch_size * args.data_parallel_size
    _require(final % per_step == 0,
             f"--step-batch-size-schedule: its last batch size ({final}) must be divisible by --micro-batch-size "
             f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size})")


def _validate_optimizer_instances(args):
    """--num-distributed-optimizer-instances N: the DP x CP group (and the expert-DP group) split into N parts."""
    n = args.num_distributed_optimizer_instances
    _require(n >= 1, f"--num-distributed-optimizer-instances ({n}) must be >= 1")
    if n == 1:
        return
    _require(args.use_distributed_optimizer, "--num-distributed-optimizer-instances > 1 replicates the distributed "
                                             "optimizer's shards: add --use-distributed-optimizer")
    _require(not getattr(args, "use_layer_wise_distributed_optimizer", False),
             "--num-distributed-optimizer-instances > 1 applies to --use-distributed-optimizer; the layer-wise "
             "optimizer (dist_muon) shards over the whole data-parallel group: drop the flag")
    dp_cp = args.data_parallel_size * args.context_parallel_size
    _require(dp_cp % n == 0, f"--num-distributed-optimizer-instances ({n}) must divide the data-parallel x context-"
                             f"parallel size ({dp_cp})")
    if args.num_experts:
        etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        edp = args.world_size // (etp * args.expert_model_parallel_size * args.pipeline_model_parallel_size)
        _require(edp % n == 0, f"--num-distributed-optimizer-instances ({n}) must divide the expert data-parallel "
                               f"size ({edp})")


def _validate_pipeline_split(args):
    """Every layer lands on exactly one stage: never a silently dropped layer."""
    pp = args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if hybrid_pipeline_placed_by_pattern(args):
        return  # the pattern's '|' markers place every layer (checked in hybrid_args.py)
    if args.pipeline_model_parallel_layout is not None:
        _validate_layout(args)
        return
    if first is None and last is None and not (args.account_for_embedding_in_pipeline_split
                                               or args.account_for_loss_in_pipeline_split):
        _require(args.num_layers % pp == 0,
                 f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}); "
                 "or set --decoder-first/last-pipeline-num-layers for an uneven split")
        return
    _require(pp > 1, "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split need "
                     "--pipeline-model-parallel-size > 1")
    for flag, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        _require(value is None or value >= 0, f"{flag} ({value}) must be >= 0")
    split = SimpleNamespace(num_layers=args.num_layers, num_layers_in_first_pipeline_stage=first,
                            num_layers_in_last_pipeline_stage=last,
                            account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
                            account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split)
    try:
        layers_per_pipeline_rank(split, pp)
    except ValueError as e:
        _require(False, f"pipeline split: {e}")


def _validate_layout(args):
    """--pipeline-model-parallel-layout: it alone places the layers, and it holds this model's."""
    _require(args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None
             and not args.account_for_embedding_in_pipeline_split and not args.account_for_loss_in_pipeline_split,
             "--pipeline-model-parallel-layout places every layer itself: drop --decoder-first/last-pipeline-"
             "num-layers and --account-for-embedding/loss-in-pipeline-split")
    try:
        layout = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size)
        layout.validate_layer_layout(args.num_layers, args.mtp_num_layers)
    except ValueError as e:
        _require(False, str(e))


def _validate_virtual_pipeline(args):
    pp = args.pipeline_model_parallel_size
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    _require(per_stage is None or per_rank is None,
             "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are "
             "mutually exclusive; pass one")
    if args.defer_embedding_wgrad_compute:
        _require(pp > 1, "--defer-embedding-wgrad-compute hides the output layer's weight gradient behind the "
                         "pipeline flush: it needs --pipeline-model-parallel-size > 1 (as in Megatron)")
        _require(args.gradient_accumulation_fusion,
                 "--defer-embedding-wgrad-compute adds the parked weight gradients straight into the gradient "
                 "buffer: drop --no-gradient-accumulation-fusion (as in Megatron)")
    _require(args.wgrad_deferral_limit >= 0,
             f"--wgrad-deferral-limit must be >= 0 (0: park every output-layer GEMM), got {args.wgrad_deferral_limit}")
    _require(args.wgrad_deferral_limit == 0 or args.defer_embedding_wgrad_compute,
             f"--wgrad-deferral-limit {args.wgrad_deferral_limit} bounds the GEMMs --defer-embedding-wgrad-compute "
             "parks: add that flag or drop the limit")
    if args.pipeline_model_parallel_layout is not None:
        # Its PP x VP entries set the virtual stages per rank, as in Megatron.
        _require(per_stage is None and per_rank is None,
                 "--pipeline-model-parallel-layout sets the virtual stages per pipeline rank (its number of "
                 "stages / --pipeline-model-parallel-size): drop --num-layers-per-virtual-pipeline-stage and "
                 "--num-virtual-stages-per-pipeline-rank")
        try:
            layout = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, pp)
        except ValueError as e:
            _require(False, str(e))
        vp = layout.virtual_pipeline_model_parallel_size
        per_rank = vp if vp > 1 else None
    args.virtual_pipeline_model_parallel_size = None
    if per_stage is None and per_rank is None:
        _require(not args.overlap_p2p_comm_warmup_flush,
                 "--overlap-p2p-communication-warmup-flush needs the interleaved schedule: add "
                 "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank")
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps its p2p (as in Megatron)
        return
    _require(pp > 1, "interleaved pipelining (virtual stages) needs --pipeline-model-parallel-size > 1")
    if per_stage is not None:
        _require(args.num_layers is not None and (args.num_layers // pp) % per_stage == 0,
                 f"--num-layers per pipeline stage ({(args.num_layers or 0) // pp}) must be divisible by "
                 f"--num-layers-per-virtual-pipeline-stage ({per_stage})")
        args.virtual_pipeline_model_parallel_size = (args.num_layers // pp) // per_stage
    else:
        args.virtual_pipeline_model_parallel_size = per_rank
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    _require(not args.overlap_p2p_comm_warmup_flush or args.overlap_p2p_comm,
             "--overlap-p2p-communication-warmup-flush extends the p2p overlap to warm-up and flush: drop "
             "--no-overlap-p2p-communication or the warm-up flag")
    if not args.virtual_pipeline_model_parallel_size:
        _require(not args.overlap_p2p_comm_warmup_flush,
                 "--overlap-p2p-communication-warmup-flush needs more than one virtual stage per pipeline rank")
        args.overlap_p2p_comm = False


def _validate_microbatch_group(args):
    group, pp = args.microbatch_group_size_per_vp_stage, args.pipeline_model_parallel_size
    if group is None:
        return
    flag = f"--microbatch-group-size-per-virtual-pipeline-stage ({group})"
    _require(bool(args.virtual_pipeline_model_parallel_size),
             f"{flag} orders the interleaved schedule: it needs virtual pipeline stages "
             "(--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank)")
    _require(group >= pp, f"{flag} must be at least --pipeline-model-parallel-size ({pp})")


def _validate_batch(args):
    _require(args.micro_batch_size is not None and args.micro_batch_size > 0,
             "--micro-batch-size is required and must be > 0")
    if args.step_batch_size_schedule is not None:
        _validate_step_schedule(args)
    else:
        _validate_constant_batch(args)
    _validate_eval_batch(args)


def _validate_eval_batch(args):
    """Evaluation's own batch (Megatron's): defaults to the training one's; whole micro-batches per DP rank."""
    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    per_step = args.eval_micro_batch_size * args.data_parallel_size
    _require(args.eval_micro_batch_size > 0 and args.eval_global_batch_size > 0,
             "--eval-micro-batch-size and --eval-global-batch-size must be > 0")
    _require(args.eval_global_batch_size % per_step == 0,
             f"--eval-global-batch-size ({args.eval_global_batch_size}) must be divisible by --eval-micro-batch-size "
             f"({args.eval_micro_batch_size}) x data-parallel size ({args.data_parallel_size})")


def _validate_constant_batch(args):
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
        if args.rank == 0:
            print(f"setting global batch size to {args.global_batch_size}", flush=True)
    _require(args.global_batch_size > 0, f"--global-batch-size ({args.global_batch_size}) must be > 0")
    if args.rampup_batch_size is not None:
        _require(len(args.rampup_batch_size) == 3,
                 "--rampup-batch-size expects 3 values: <start batch size> <increment> <ramp-up samples>")
        try:
            start, incr, samples = (int(v) for v in args.rampup_batch_size)
        except ValueError:
            raise ArgumentError("--rampup-batch-size values must be integers") from None
        _require(start > 0 and incr > 0 and samples >= 0,
                 "--rampup-batch-size: start and increment must be > 0, ramp-up samples >= 0")
        _require(args.global_batch_size >= start and (args.global_batch_size - start) % incr == 0,
                 f"--rampup-batch-size: --global-batch-size ({args.global_batch_size}) minus the start batch "
                 f"size ({start}) must be a non-negative multiple of the increment ({incr})")
        _require(args.train_samples is not None,
                 "--rampup-batch-size requires --train-samples (the run length in samples), not --train-iters")
        _require(start % (mbs * dp) == 0 and incr % (mbs * dp) == 0 or args.decrease_batch_size_if_needed,
                 f"--rampup-batch-size start ({start}) and increment ({incr}) must be divisible by "
                 f"--micro-batch-size ({mbs}) x data-parallel size ({dp})")
    elif not args.decrease_batch_size_if_needed:
        _require(args.global_batch_size % (mbs * dp) == 0,
                 f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
                 f"({mbs}) x data-parallel size ({dp})")


def _validate_logging_intervals(args):
    n = args.log_memory_interval
    if n is not None:
        _require(n > 0 and n % args.log_interval == 0, f"--log-memory-interval ({n}) must be a positive multiple of "
                                                       f"--log-interval ({args.log_interval}): it reports at log lines")


def _validate_offloading(args):
    """--cpu-offloading-num-layers: Megatron's limits, in one line before the model is built."""
    n = args.cpu_offloading_num_layers
    if not n:
        return
    try:
        check_offloading(n, args.num_layers, args.pipeline_model_parallel_size, args.recompute_granularity)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    _require(not args.torch_compile, "--cpu-offloading-num-layers moves the tensors autograd saves through its "
                                     "saved-tensor hooks, which compiled layers bypass: drop --torch-compile or it")


def _validate_model(args):
    for flag, name in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"),
                       ("--max-position-embeddings", "max_position_embeddings")):
        value = getattr(args, name)
        _require(value is not None and value > 0, f"{flag} is required and must be > 0")
    if args.seq_length is None:
        args.seq_length = args.encoder_seq_length
    _require(args.seq_length is not None and args.seq_length > 0, "--seq-length is required and must be > 0")
    args.encoder_seq_length = args.seq_length
    _require(args.max_position_embeddings >= args.seq_length,
             f"--max-position-embeddings ({args.max_position_embeddings}) must be >= --seq-length "
             f"({args.seq_length})")
    _validate_pipeline_split(args)
    _validate_heads(args)
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # 2/3 of 4h keeps the parameter count of a 4h GeLU MLP; rounded down to a multiple of 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    _validate_positions(args)
    _require(sum([args.swiglu, args.squared_relu, args.openai_gelu, args.quick_geglu]) <= 1,
             "--swiglu, --squared-relu, --openai-gelu and --quick-geglu are mutually exclusive; pass one")
    glu_shaped = bool(args.glu_linear_offset) or args.activation_func_clamp_value is not None
    _require(args.swiglu or args.quick_geglu or not glu_shaped,
             "--glu-linear-offset / --activation-func-clamp-value shape a gated linear unit: they need --swiglu or "
             "--quick-geglu")
    _require(args.activation_func_clamp_value is None or args.activation_func_clamp_value > 0,
             f"--activation-func-clamp-value must be > 0, got {args.activation_func_clamp_value}")
    if args.add_bias_linear:
        args.add_qkv_bias = True
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.moe_layer_recompute:  # Megatron's older spelling of the "moe" recompute module
        _warn(args, "--moe-layer-recompute is deprecated in Megatron; it is --recompute-granularity selective "
                    "--recompute-modules moe")
        _require(args.recompute_granularity != "full",
                 "--moe-layer-recompute recomputes the MoE layers selectively; drop --recompute-granularity full")
        args.recompute_granularity = "selective"
        modules = list(args.recompute_modules or ["core_attn"])
        args.recompute_modules = modules + ([] if "moe" in modules else ["moe"])
    if args.recompute_granularity == "selective":
        _require(args.recompute_method is None,
                 "--recompute-method is only valid with --recompute-granularity full")
    _require(args.make_vocab_size_divisible_by > 0, "--make-vocab-size-divisible-by must be > 0")
    for flag, p in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        _require(0.0 <= p < 1.0, f"{flag} ({p}) must be in [0, 1)")


def _validate_heads(args):
    heads, tp, h = args.num_attention_heads, args.tensor_model_parallel_size, args.hidden_size
    if args.kv_channels is None:
        _require(h % heads == 0,
                 f"--hidden-size ({h}) must be divisible by --num-attention-heads ({heads}), or pass --kv-channels")
        args.kv_channels = h // heads
    _require(heads % tp == 0,
             f"--num-attention-heads ({heads}) must be divisible by --tensor-model-parallel-size ({tp})")
    if not args.group_query_attention:
        args.num_query_groups = heads
    groups = args.num_query_groups
    _require(groups > 0 and heads % groups == 0,
             f"--num-attention-heads ({heads}) must be divisible by --num-query-groups ({groups})")
    _require(groups % tp == 0,
             f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size ({tp})")


def _validate_positions(args):
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        _require(args.position_embedding_type in ("learned_absolute", "none"),
                 "--no-position-embedding conflicts with --position-embedding-type")
        args.position_embedding_type = "none"
    _require(0.0 < args.rotary_percent <= 1.0, f"--rotary-percent ({args.rotary_percent}) must be in (0, 1]")
    if args.position_embedding_type == "mrope":
        _require(args.mrope_section is not None and len(args.mrope_section) == 3,
                 "--position-embedding-type mrope needs --mrope-section with three values (temporal, height, "
                 "width bands), e.g. --mrope-section 16 24 24")
    else:
        _require(args.mrope_section is None, "--mrope-section applies to --position-embedding-type mrope only")


def _validate_precision(args):
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive; pass one")
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.fp16 and args.loss_scale is None:
        args.check_for_nan_in_loss_and_grad = False  # the dynamic scaler skips inf/nan steps instead
    if args.bf16 and not args.grad_reduce_in_bf16 and args.main_grads_dtype == torch.float32:
        args.accumulate_allreduce_grads_in_fp32 = True  # bf16 main grads (precision-aware) stay bf16
    _require(not args.fp16_lm_cross_entropy or args.fp16, "--fp16-lm-cross-entropy requires --fp16")
    _require(not args.fp32_residual_connection or args.fp16 or args.bf16,
             "--fp32-residual-connection requires --fp16 or --bf16")


def _validate_non_persistent_checkpoints(args):
    kind = args.non_persistent_ckpt_type
    _require(kind in (None, "global"), f"--non-persistent-ckpt-type {kind} is not supported: local and in_memory "
                                       "checkpoints need nvidia-resiliency-ext's managers; use global")
    _require(args.non_persistent_local_ckpt_dir is None and args.non_persistent_local_ckpt_algo == "fully_parallel",
             "--non-persistent-local-ckpt-dir / -algo belong to local non-persistent checkpoints, which are not built "
             "here; use --non-persistent-ckpt-type global")
    if args.non_persistent_save_interval is not None:
        _require(args.non_persistent_save_interval >= 1, "--non-persistent-save-interval must be >= 1")
        _require(kind == "global", "--non-persistent-save-interval needs --non-persistent-ckpt-type global")
        _require(args.save is not None, "--non-persistent-save-interval needs --save (the run's checkpoints)")


def _validate_run_length(args):
    if args.skip_train:
        if args.train_iters is None and args.train_samples is None:
            args.train_iters = 0
    _require(not (args.train_iters is not None and args.train_samples is not None),
             "--train-iters and --train-samples are mutually exclusive; pass one")
    _require(args.train_iters is not None or args.train_samples is not None,
             "pass --train-iters or --train-samples to set the run length")
    _require(all(i >= 1 for i in args.iterations_to_skip),
             f"--iterations-to-skip counts iterations from 1, as the log does; got {args.iterations_to_skip}")
    _require(args.train_sync_interval is None or args.train_sync_interval >= 1,
             f"--train-sync-interval must be >= 1, got {args.train_sync_interval}")
    if args.train_iters is not None:
        for flag, name in (("--lr-decay-samples", "lr_decay_samples"), ("--lr-wsd-decay-samples",
                                                                          "lr_wsd_decay_samples")):
            _require(getattr(args, name) is None, f"{flag} needs a sample-based run (--train-samples)")
        _require(args.lr_warmup_samples == 0, "--lr-warmup-samples needs a sample-based run (--train-samples)")
        _require(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
                 "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive; pass one")
    else:
        for flag, name in (("--lr-decay-iters", "lr_decay_iters"), ("--lr-wsd-decay-iters", "lr_wsd_decay_iters")):
            _require(getattr(args, name) is None, f"{flag} needs an iteration-based run (--train-iters)")
        _require(args.lr_warmup_iters == 0, "--lr-warmup-iters needs an iteration-based run (--train-iters)")
        _require(args.lr_warmup_fraction is None or args.lr_warmup_samples == 0,
                 "--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive; pass one")
    _require(args.lr_warmup_fraction is None or 0.0 <= args.lr_warmup_fraction < 1.0,
             f"--lr-warmup-fraction ({args.lr_warmup_fraction}) must be in [0, 1)")
    if not args.skip_train:
        _require(args.lr is not None, "--lr is required for training")
    if args.lr is not None:
        _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    if args.lr_decay_style == "WSD":
        _require(args.lr_wsd_decay_iters is not None or args.lr_wsd_decay_samples is not None,
                 "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    _require(args.log_interval > 0, f"--log-interval ({args.log_interval}) must be > 0")
    _require(args.eval_interval is None or args.eval_interval > 0, "--eval-interval must be > 0")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0")
    for flag, value in (("--exit-interval", args.exit_interval), ("--exit-duration-in-mins",
                                                                   args.exit_duration_in_mins),
                        ("--check-weight-hash-across-dp-replicas-interval",
                         args.check_weight_hash_across_dp_replicas_interval)):
        _require(value is None or value > 0, f"{flag} ({value}) must be > 0")
    _require(args.manual_gc_interval >= 0, f"--manual-gc-interval ({args.manual_gc_interval}) must be >= 0")


def _validate_checkpointing(args):
    _require(args.ckpt_format in ("torch", "torch_dist"),
             f"--ckpt-format {args.ckpt_format} is not supported yet: use torch_dist (sharded; it reshards across TP, "
             f"PP, DP and FSDP layouts and loads Megatron's torch_dist checkpoints)")
    if args.save is not None:
        _require(args.save_interval is not None and args.save_interval > 0,
                 "--save requires --save-interval > 0")
    if args.log_progress and args.save is None:
        _warn(args, "--log-progress writes progress.txt in the --save directory; without --save nothing is written")
    _require(not getattr(args, "ckpt_save_megatron_layout", False) or args.ckpt_format == "torch_dist",
             "--ckpt-save-megatron-layout writes Megatron-LM's torch_dist layout; pass --ckpt-format torch_dist")
    if args.skip_train and args.no_load_optim is None:
        args.no_load_optim = True
    _require(not args.verify_integrity or args.ckpt_format == "torch_dist",
             f"--verify-integrity needs --ckpt-format torch_dist (got {args.ckpt_format})")
    for name in ("no_save_optim", "no_save_rng", "no_load_optim", "no_load_rng"):
        if getattr(args, name) is None:
            setattr(args, name, False)


def _validate_data(args):
    sources = [args.mock_data, bool(args.data_path) or args.data_args_path is not None,
               bool(args.train_data_path or args.valid_data_path or args.test_data_path)
               or args.per_split_data_args_path is not None]
    _require(sum(sources) <= 1, "pass only one data source: --mock-data, --data-path, or "
                                "--train-data-path/--valid-data-path/--test-data-path")
    if sum(sources) == 0:
        # Megatron accepts this too: its dataset config falls back to mock data without a blend.
        args.mock_data = True
        _warn(args, "no --data-path / --train-data-path / --mock-data given: using mock data")
    _require(not (args.data_path and args.data_args_path), "--data-path and --data-args-path are exclusive")
    if args.data_args_path is not None:
        _require(os.path.isfile(args.data_args_path), f"--data-args-path file not found: {args.data_args_path}")
        with open(args.data_args_path) as f:
            args.data_path = f.read().split()
    for flag, blend in (("--data-path", args.data_path), ("--train-data-path", args.train_data_path),
                        ("--valid-data-path", args.valid_data_path), ("--test-data-path", args.test_data_path)):
        if reads_image_text_data(args):
            break
        for prefix in (blend_prefixes_checked(flag, blend, _require) if blend else []):
            if args.sft:
                _require(os.path.isfile(prefix), f"{flag}: conversation file {prefix} not found (--sft takes JSONL "
                                                 "files or the .npz of tools/prepare_sft_data.py)")
                continue
            for ext in (".bin", ".idx"):
                _require(os.path.isfile(prefix + ext),
                         f"{flag}: dataset file {prefix + ext} not found (pass the prefix of a .bin/.idx pair "
                         "written by tools/preprocess_data.py)")
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"
        _warn(args, "--split not given with --data-path; using 969, 30, 1")
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    _require(args.num_workers >= 0, "--num-workers must be >= 0")


def blend_prefixes(blend):
    """Dataset prefixes of a blend list: 'p1 p2' or 'w1 p1 w2 p2'."""
    if len(blend) % 2 == 0 and blend:
        try:
            [float(w) for w in blend[0::2]]
            return list(blend[1::2])
        except ValueError:
            pass
    return list(blend)


_TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",), "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",), "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",), "TikTokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",), "MultimodalTokenizer": ("tokenizer_model",),
    "SFTTokenizer": ("tokenizer_model",),
}


def _validate_tokenizer(args):
    _require(args.tokenizer_type is not None, "--tokenizer-type is required (e.g. GPT2BPETokenizer, NullTokenizer)")
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None and args.vocab_size > 0,
                 "--tokenizer-type NullTokenizer requires --vocab-size")
        return
    for name in _TOKENIZER_FILES.get(args.tokenizer_type, ()):
        path, flag = getattr(args, name), "--" + name.replace("_", "-")
        _require(path is not None, f"--tokenizer-type {args.tokenizer_type} requires {flag}")
        if args.tokenizer_type == "HuggingFaceTokenizer" and not os.path.exists(path):
            continue  # may be a hub model id
        _require(os.path.exists(path), f"{flag}: file not found: {path}")


def _validate_misc(args):
    args.consumed_train_samples, args.skipped_train_samples, args.consumed_valid_samples = 0, 0, 0
    args.iteration, args.num_floating_point_operations_so_far = 0, 0
    _require(hasattr(signal, args.exit_signal) and args.exit_signal.startswith("SIG"),
             f"--exit-signal ({args.exit_signal}) is not a signal name; use e.g. SIGTERM or SIGUSR1")
    if args.wandb_project:  # every rank checks, though only the last one logs: all of them stop together
        try:
            import wandb  # noqa: F401  # lazy: ~0.9 s to import, only with --wandb-project
        except ImportError as e:
            raise ArgumentError(f"--wandb-project needs the wandb package ({e}): pip install wandb, "
                                "or bash scripts/install_deps.sh") from None
