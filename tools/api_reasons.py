"""Why a Megatron Core 0.19.2 name is absent here, or why its signature differs (read by
tools/api_report.py). Keys are `module:name`, `*:name` or `module:*`; the first match wins in that order.
"""
C = "megatron.core."
T = "megatron.training."

MLA = ("MLATransformerConfig inherits TransformerConfig's fp8_recipe default ('tensorwise', the one FP8 recipe "
       "without Transformer Engine)")
INFER = ("not implemented: the generation engine (megatron/core/inference) keeps its own KV cache and runs "
         "the training layers, without Megatron's inference-optimized layers or InferenceParams")
CG = "CUDA-graph scopes of Megatron's TE/local graph capture; here only --cuda-graph-impl full_iteration exists"
CKPT_STRATEGY = ("torch_dist checkpoints are written by megatron.core.dist_checkpointing.strategies.torch's own "
                 "dcp_write / tensor_shards helpers and planners; Megatron's planner classes and state-dict "
                 "conversions are internals (the TorchDist*ShardedStrategy objects are accepted by save/load)")
HYBRID = "hybrid (Mamba) models are not implemented, so there is no HybridModelConfig to build"
SHARED_OVERLAP = ("--moe-shared-expert-overlap runs the shared experts on a side CUDA stream inside MoELayer; "
                  "Megatron's staged overlap (state machine split across the token dispatcher) is not used")
DATA_CFG = ("dataset config fields for object-storage / fast-cache loading and CP-aware packing "
            "(defer_npy_index_mmap, fast_cache_load, context/data_parallel_size...) are not implemented")

REASONS = {
    # megatron.core
    C[:-1] + ":InferenceParams": INFER,
    C + "enums:Fp4Recipe": "FP4 training needs Transformer Engine, which is not used",
    C + "enums:Fp8Recipe": "the 'custom' recipe (user quantizer factories) needs Transformer Engine",
    C + "process_groups_config:MultiModuleProcessGroupCollection":
        "multi-module (MIMO / vision+language) models are not implemented",
    # tensor_parallel
    **{C + "tensor_parallel:" + n: ("Megatron's inference linears subclass Transformer Engine's layers (with "
                                    "symmetric-memory all-gathers); Transformer Engine is not used, and the "
                                    "generation engine runs the training layers")
       for n in ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear",
                 "InferenceRowParallelLinear")},
    # transformer
    "*:MLATransformerConfig": MLA,
    C + "transformer:TransformerConfig":
        "fp8_recipe defaults to 'tensorwise', the one FP8 recipe without Transformer Engine",
    C + "transformer.transformer_config:TransformerConfig":
        "fp8_recipe defaults to 'tensorwise', the one FP8 recipe without Transformer Engine",
    C + "transformer.enums:AttnMaskType": "causal_bottom_right (TE's KV-cache mask) needs Transformer Engine attention",
    C + "transformer.enums:LayerType":
        "embedding/loss/mtp entries serve --pipeline-model-parallel-layout, not implemented",
    C + "transformer.attention:SelfAttention":
        "pp_layer_offset/name belong to MTP and TE naming; extra keyword arguments are accepted and unused",
    C + "transformer.attention:CrossAttention":
        "name is TE's module name; extra keyword arguments are accepted and unused",
    C + "transformer.transformer_layer:TransformerLayer":
        "pp_layer_offset (Megatron's per-stage KV-cache index) is refused: the KV cache is indexed by the global "
        "layer number",
    C + "transformer:TransformerLayer": "see megatron.core.transformer.transformer_layer.TransformerLayer",
    C + "transformer.mlp:MLP": "name is TE's module name; extra keyword arguments are accepted and unused",
    C + "transformer.mlp:MLPSubmodules": "the activation is chosen by config.activation_func, not by the spec",
    C + "transformer.module:GraphableMegatronModule": CG,
    # MoE, MLA, MTP
    C + "transformer.moe.experts:InferenceGroupedMLP": INFER,
    C + "transformer.moe.router:InferenceTopKRouter": INFER,
    C + "models.gpt.moe_module_specs:get_inference_optimized_moe_spec": INFER,
    C + "models.backends:InferenceSpecProvider": INFER,
    C + "transformer.moe.token_dispatcher:MoEFlexTokenDispatcher": "the flex dispatcher needs DeepEP / HybridEP "
        "kernels, which this build does not have (--moe-token-dispatcher-type allgather or alltoall)",
    C + "transformer.moe.moe_utils:MoECudaGraphPartialCaptureSignal": CG,
    C + "transformer.moe.moe_utils:MoECudaGraphTensorStore": CG,
    C + "transformer.moe.moe_utils:maybe_skip_or_early_return_by_cudagraph": CG,
    C + "transformer.moe.shared_experts:FusedSharedExpertMLP": "shared experts through the routed experts' "
        "grouped GEMM (use_grouped_gemm_for_shared_expert) are not implemented",
    C + "transformer.moe.shared_experts:SharedExpertState": SHARED_OVERLAP,
    C + "transformer.moe.shared_experts:overlap_state_check": SHARED_OVERLAP,
    C + "transformer.moe.shared_experts:set_tensor_grad_fn_sequence_sr": SHARED_OVERLAP,
    C + "transformer.multi_latent_attention:FusedMLASelfAttention": "the fused MLA down projection "
        "(mla_down_proj_fusion) needs Transformer Engine",
    C + "transformer.multi_token_prediction:process_mtp_loss": "GPTModel attaches the MTP losses to its per-token "
        "loss from the depth outputs (loss, mtp_hidden_states, labels, loss_mask, output_layer, output_weight, "
        "compute_language_model_loss, config); Megatron attaches them to the hidden states",
    # models
    C + "models.gpt.gpt_layer_specs:get_gpt_layer_with_inference_spec": INFER,
    C + "models.gpt.gpt_layer_specs:get_gpt_layer_with_inference_submodules": INFER,
    C + "models.gpt.gpt_layer_specs:get_mlp_module_spec": "use_te defaults to False: the local MLP is the only one",
    C + "models.gpt.gpt_layer_specs:get_gpt_layer_local_spec": "NVIDIA Kitchen attention is not implemented",
    C + "models.bert.pooler:Pooler": "BertModel's binary head pools the first token itself",
    C + "models.T5.t5_model:t5_extended_attention_mask": "t5_attention_masks builds all three T5 masks",
    C + "models.T5.t5_model:t5_position_ids": "T5Model computes its position ids internally",
    C + "models.common.embeddings.rotary_pos_embedding:MultimodalRotaryEmbedding":
        "multimodal (mRoPE) models are not implemented",
    # optimizer
    C + "optimizer:AdamOptimizerConfig": "OptimizerConfig(optimizer='adam') holds the Adam settings",
    C + "optimizer:SGDOptimizerConfig": "OptimizerConfig(optimizer='sgd') holds the SGD settings",
    C + "optimizer:HAVE_EMERGING_OPTIMIZERS": "Muon/SOAP/Lion (emerging optimizers) are not implemented",
    C + "optimizer:HybridDeviceOptimizer": "CPU-offloaded optimizer steps are not implemented",
    C + "optimizer:LayerWiseDistributedOptimizer": "the layer-wise distributed optimizer (for Muon) is not implemented",
    C + "optimizer.distrib_optimizer:Range": "the distributed optimizer keeps (start, end) tuples",
    # pipeline
    C + "pipeline_parallel.schedules:*": "internal helper of Megatron's schedule implementation",
    C + "pipeline_parallel.p2p_communication:is_single_shape": "P2PCommunicator sends one tensor shape per stage",
    # dist_checkpointing
    C + "dist_checkpointing.strategies.torch:*": CKPT_STRATEGY,
    C + "dist_checkpointing.strategies.torch:get_async_strategy": (
        "returns Megatron's async writer modules (nvidia-resiliency-ext or its own FileSystemWriterAsync / "
        "state_dict_saver); async saves here are AsyncRequest / AsyncCallsQueue threads without those modules"),
    "*:LocalNonpersistentObject": "non-persistent entries are dropped by the caller before saving",
    # datasets
    C + "datasets.blended_megatron_dataset_config:*": DATA_CFG, C + "datasets.gpt_dataset:*": DATA_CFG,
    C + "datasets.bert_dataset:*": DATA_CFG, C + "datasets.t5_dataset:*": DATA_CFG,
    C + "datasets.masked_dataset:*": DATA_CFG, C + "datasets.indexed_dataset:*": DATA_CFG,
    # fusions, utils
    C + "utils:StragglerDetector": "--log-straggler (per-rank CUDA-event timing reports) is not implemented",
    # training
    T[:-1] + ":set_startup_timestamps": "startup timing is printed by pretrain itself",
    T + "argument_utils:hybrid_config_from_args": HYBRID,
    T + "arguments:validate_model_config_args_from_heterogeneous_config":
        "heterogeneous (per-layer) model configs are not implemented",
}


def reason_for(module, name):
    for key in (f"{module}:{name}", f"*:{name}", f"{module}:*"):
        if key in REASONS:
            return REASONS[key]
    return "not implemented yet"
