"""Megatron 0.19's configuration containers: the training settings grouped into dataclasses
(``PretrainConfigContainer``: train, validation, model, optimizer, scheduler, ddp, dist, rng, logger,
checkpoint, profiling, tokenizer, rerun_state_machine, straggler; ``InferenceConfigContainer``).

Each section's fields are Megatron's names; almost all are flag destinations, so their defaults are
the flags' defaults (read from megatron_flags_0.19.2.tsv) and ``argument_utils`` fills them from
parsed args by name. ``pretrain(cfg_container, ...)`` accepts a PretrainConfigContainer as Megatron
0.19.2's does: the model section, when given, builds the model; the other sections mirror the flags
the run was parsed with.
"""
import dataclasses
from typing import Any, Dict

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.training.arguments.megatron_flags import load_specs

# Section -> Megatron's field names (in its order). Fields without a flag of the same name get the
# defaults in _NOT_FLAGS.
_SECTIONS = {
    "TrainingConfig": "micro_batch_size global_batch_size rampup_batch_size step_batch_size_schedule "
        "decrease_batch_size_if_needed empty_unused_memory_level check_weight_hash_across_dp_replicas_interval "
        "gpu_sniff_test_interval train_sync_interval train_iters train_samples exit_interval exit_duration_in_mins "
        "exit_signal_handler exit_signal exit_signal_handler_for_dataloader exit_signal_handler_for_training "
        "manual_gc manual_gc_interval manual_gc_eval iterations_to_skip",
    "ValidationConfig": "eval_iters eval_interval start_eval_at_iter eval_global_batch_size eval_micro_batch_size "
        "skip_train test_mode full_validation multiple_validation_sets validation_set_names",
    "SchedulerConfig": "lr_decay_style lr_wsd_decay_style lr_decay_iters lr_decay_samples lr_wsd_decay_iters "
        "lr_wsd_decay_samples lr_warmup_fraction lr_warmup_iters lr_warmup_samples lr_warmup_init "
        "override_opt_param_scheduler use_checkpoint_opt_param_scheduler start_weight_decay end_weight_decay "
        "weight_decay_incr_style no_weight_decay_cond_type",
    "LoggerConfig": "log_interval log_params_norm log_throughput log_throughput_to_tensorboard throughput_window_size "
        "log_progress timing_log_level timing_log_option tensorboard_dir tensorboard_log_interval "
        "tensorboard_queue_size log_timers_to_tensorboard log_loss_scale_to_tensorboard "
        "log_validation_ppl_to_tensorboard log_memory_to_tensorboard memory_keys log_memory_interval "
        "log_device_memory_used log_l2_norm_grad_to_tensorboard log_num_zeros_in_grad log_max_attention_logit "
        "log_runtime_to_tensorboard runtime_time_unit barrier_with_L1_time log_world_size_to_tensorboard "
        "wandb_project wandb_exp_name wandb_save_dir wandb_entity logging_level filter_warnings modules_to_filter "
        "set_level_for_all_loggers log_energy save_config_filepath moe_routing_trace_path "
        "moe_routing_trace_max_training_iters moe_routing_trace_capture_logits "
        "moe_routing_trace_capture_hidden_states moe_routing_trace_dump_weights",
    "CheckpointConfig": "save save_interval save_params_interval save_activations_interval "
        "save_tokens_per_expert_interval save_wgrads_interval save_dgrads_interval save_retain_interval "
        "most_recent_k save_optim save_rng load load_optim load_main_params_from_ckpt load_rng "
        "non_persistent_save_interval non_persistent_ckpt_type non_persistent_global_ckpt_dir "
        "non_persistent_local_ckpt_dir non_persistent_local_ckpt_algo finetune pretrained_checkpoint ckpt_step "
        "use_checkpoint_args use_mp_args_from_checkpoint_args use_tokenizer_model_from_checkpoint_args "
        "exit_on_missing_checkpoint ckpt_format auto_detect_ckpt_format ckpt_convert_format ckpt_convert_save "
        "ckpt_convert_update_legacy_dist_opt_format fully_parallel_save async_save async_strategy "
        "use_persistent_ckpt_worker async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm "
        "fully_parallel_load ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_save_process_group "
        "ckpt_fully_parallel_load_process_group ckpt_assume_constant_structure "
        "ckpt_load_validate_sharding_integrity strict_fsdp_dtensor_load dist_ckpt_strictness "
        "dist_ckpt_save_pre_mcore_014 dist_ckpt_optim_fully_reshardable "
        "distrib_optim_fully_reshardable_mem_efficient save_tokenizer_assets replication replication_jump "
        "replication_factor verify_integrity stream_ckpt_dequant",
    "TokenizerConfig": "vocab_size padded_vocab_size pad_vocab_size vocab_file merge_file vocab_extra_ids "
        "tokenizer_type tokenizer_model metadata_path special_tokens tiktoken_pattern tiktoken_num_special_tokens "
        "tokenizer_sentencepiece_legacy tokenizer_sentencepiece_ignore_extra_whitespaces tokenizer_hf_no_use_fast "
        "tokenizer_hf_no_include_special_tokens trust_remote_code null_tokenizer_eod_id null_tokenizer_pad_id "
        "chat_template",
    "RNGConfig": "seed te_rng_tracker inference_rng_tracker data_parallel_random_init",
    "ProfilingConfig": "use_nsys_profiler profile_step_start profile_step_end use_pytorch_profiler "
        "pytorch_profiler_collect_shapes pytorch_profiler_collect_callstack pytorch_profiler_collect_chakra "
        "profile_ranks record_memory_history memory_snapshot_path record_shapes nvtx_ranges",
    "DistributedInitConfig": "distributed_backend distributed_timeout_minutes align_grad_reduce local_rank "
        "lazy_mpu_init use_megatron_fsdp use_torch_fsdp2 nccl_communicator_config_path use_tp_pp_dp_mapping "
        "use_gloo_process_groups use_sharp sharp_enabled_group high_priority_stream_groups "
        "distributed_timeout_seconds_after_init flight_recorder_dump_path flight_recorder_trace_buffer_size "
        "flight_recorder_dump_on_timeout flight_recorder_include_stack_trace flight_recorder_include_only_active "
        "flight_recorder_extra_dump_on_exec disable_jit_fuser",
    "RerunStateMachineConfig": "error_injection_rate error_injection_type rerun_mode check_for_nan_in_loss "
        "check_for_spiky_loss",
    "StragglerDetectionConfig": "log_straggler straggler_ctrlr_port straggler_minmax_count "
        "disable_straggler_on_startup",
    "InferenceSetupConfig": "inference_batch_times_seqlen_threshold max_tokens_to_oom output_bert_embeddings "
        "bert_embedder_type cuda_graph_modules use_legacy_static_engine inference_max_requests "
        "inference_max_seq_length inference_dynamic_batching inference_dynamic_batching_buffer_size_gb "
        "inference_dynamic_batching_paused_buffer_size_gb inference_dynamic_batching_mamba_memory_ratio "
        "inference_dynamic_batching_block_size inference_dynamic_batching_max_requests "
        "inference_dynamic_batching_max_tokens inference_dynamic_batching_num_cuda_graphs "
        "inference_dynamic_batching_track_paused_request_events "
        "inference_dynamic_batching_track_generated_token_events inference_dynamic_batching_unified_memory_level "
        "inference_dynamic_batching_cuda_graph_mixed_prefill_count "
        "inference_dynamic_batching_cuda_graph_sizing_distribution inference_dynamic_batching_sampling_backend "
        "offset_sampling_seed_by_dp_rank inference_dynamic_batching_async_sched_mode "
        "inference_dynamic_batching_logprobs_mode decode_only_cuda_graphs inference_cuda_graph_all_prefills "
        "inference_cuda_graph_max_tokens enable_chunked_prefill num_speculative_tokens "
        "inference_dynamic_batching_enable_prefix_caching inference_dynamic_batching_prefix_caching_eviction_policy "
        "inference_dynamic_batching_prefix_caching_coordinator_policy "
        "inference_dynamic_batching_prefix_caching_routing_alpha inference_dynamic_batching_prefix_caching_mamba_gb "
        "inference_logging_step_interval inference_text_gen_server_logging inference_wandb_logging "
        "inference_coordinator_port inference_use_synchronous_zmq_collectives inference_disable_ep_consensus "
        "mamba_inference_conv_states_dtype mamba_inference_ssm_states_dtype return_log_probs skip_prompt_log_probs "
        "use_flashinfer_fused_rope",
}
_NOT_FLAGS = {
    "log_throughput_to_tensorboard": False, "throughput_window_size": 100, "memory_keys": None,
    "log_l2_norm_grad_to_tensorboard": False, "log_runtime_to_tensorboard": False, "runtime_time_unit": "hours",
    "filter_warnings": True, "modules_to_filter": None, "set_level_for_all_loggers": False,
    "save_config_filepath": None, "most_recent_k": -1, "save_optim": True, "save_rng": True, "load_optim": True,
    "load_rng": True, "fully_parallel_save": True, "fully_parallel_load": False, "save_tokenizer_assets": True,
    "use_nsys_profiler": False, "check_for_nan_in_loss": True,
    "return_log_probs": False, "skip_prompt_log_probs": False, "use_flashinfer_fused_rope": False,
}


def _flag_defaults() -> Dict[str, Any]:
    return {spec.dest: spec.default for spec in load_specs()}


def _field(default):
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d))
    return dataclasses.field(default=default)


def _section(name: str, names: str, defaults: Dict[str, Any], doc: str):
    fields = [(n, Any, _field(_NOT_FLAGS[n] if n in _NOT_FLAGS else defaults.get(n))) for n in names.split()]
    cls = dataclasses.make_dataclass(name, fields, kw_only=True, namespace={"__doc__": doc})
    cls.__module__ = __name__
    return cls


_DEFAULTS = _flag_defaults()
TrainingConfig = _section("TrainingConfig", _SECTIONS["TrainingConfig"], _DEFAULTS, "The training loop.")
ValidationConfig = _section("ValidationConfig", _SECTIONS["ValidationConfig"], _DEFAULTS, "Evaluation.")
SchedulerConfig = _section("SchedulerConfig", _SECTIONS["SchedulerConfig"], _DEFAULTS,
                           "Learning-rate and weight-decay schedules.")
LoggerConfig = _section("LoggerConfig", _SECTIONS["LoggerConfig"], _DEFAULTS, "Logging and its writers.")
CheckpointConfig = _section("CheckpointConfig", _SECTIONS["CheckpointConfig"], _DEFAULTS, "Saving and loading.")
TokenizerConfig = _section("TokenizerConfig", _SECTIONS["TokenizerConfig"], _DEFAULTS, "The tokenizer.")
RNGConfig = _section("RNGConfig", _SECTIONS["RNGConfig"], _DEFAULTS, "Random seeds.")
ProfilingConfig = _section("ProfilingConfig", _SECTIONS["ProfilingConfig"], _DEFAULTS, "Profiling.")
DistributedInitConfig = _section("DistributedInitConfig", _SECTIONS["DistributedInitConfig"], _DEFAULTS,
                                 "torch.distributed set-up.")
RerunStateMachineConfig = _section("RerunStateMachineConfig", _SECTIONS["RerunStateMachineConfig"], _DEFAULTS,
                                   "Result validation (the rerun state machine).")
StragglerDetectionConfig = _section("StragglerDetectionConfig", _SECTIONS["StragglerDetectionConfig"], _DEFAULTS,
                                    "Straggler detection.")
InferenceSetupConfig = _section("InferenceSetupConfig", _SECTIONS["InferenceSetupConfig"], _DEFAULTS,
                                "The inference flags, as one declarative config.")


@dataclasses.dataclass(kw_only=True)
class _RunSections:
    """The sections both containers have, at their defaults."""
    dist: DistributedInitConfig = dataclasses.field(default_factory=DistributedInitConfig)
    rng: RNGConfig = dataclasses.field(default_factory=RNGConfig)
    profiling: ProfilingConfig = dataclasses.field(default_factory=ProfilingConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)


@dataclasses.dataclass(kw_only=True)
class PretrainConfigContainer(_RunSections):
    """Every configuration of a pretraining run (``model``: a GPTModelConfig, or None when the run
    builds its model with a model_provider function)."""
    train: TrainingConfig
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    model: Any
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    ddp: DistributedDataParallelConfig = dataclasses.field(default_factory=DistributedDataParallelConfig)
    logger: LoggerConfig
    checkpoint: CheckpointConfig
    rerun_state_machine: RerunStateMachineConfig = dataclasses.field(default_factory=RerunStateMachineConfig)
    straggler: Any = None


@dataclasses.dataclass(kw_only=True)
class InferenceConfigContainer(_RunSections):
    """What an inference entry point needs: the model, where to load it from, the inference settings."""
    model: Any
    checkpoint: CheckpointConfig
    inference: InferenceSetupConfig
    logger: LoggerConfig = dataclasses.field(default_factory=LoggerConfig)


__all__ = ["TrainingConfig", "ValidationConfig", "SchedulerConfig", "LoggerConfig", "CheckpointConfig",
           "TokenizerConfig", "RNGConfig", "ProfilingConfig", "DistributedInitConfig", "RerunStateMachineConfig",
           "StragglerDetectionConfig", "InferenceSetupConfig", "PretrainConfigContainer", "InferenceConfigContainer"]
