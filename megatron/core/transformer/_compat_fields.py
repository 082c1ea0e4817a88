"""TransformerConfig fields of Megatron Core 0.19.2 without a counterpart here, at Megatron's defaults
(accepted there, refused elsewhere: see megatron/core/_compat_fields.py)."""
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch


@dataclass
class TransformerConfigCompat:
    """TransformerConfig fields of Megatron Core 0.19.2 that have no counterpart here."""

    mtp_detach_heads: bool = False
    mtp_hybrid_override_pattern: Optional[str] = None
    flash_attention_version: Optional[Literal[2, 3, 4]] = None
    experimental_attention_variant_loss_scale_func: Any = None
    dsa_indexer_n_heads: Optional[int] = None
    dsa_indexer_head_dim: Optional[int] = None
    dsa_indexer_topk: Optional[int] = None
    dsa_indexer_topk_freq: int = 1
    dsa_indexer_skip_topk_offset: int = 0
    dsa_indexer_loss_coeff: Optional[float] = None
    dsa_indexer_use_sparse_loss: bool = False
    dsa_kernel_backend: Any = 'none'
    dsa_indexer_rope_interleaved: bool = False
    dsa_indexer_rotate_activation: bool = True
    dsa_indexer_scoring_relu: bool = True
    dsa_indexer_k_norm_epsilon: Optional[float] = None
    dsa_indexer_k_norm_fp32: bool = False
    fused_single_qkv_rope: bool = False
    fused_residual_rmsnorm: bool = False
    use_transformer_engine_op_fuser: bool = False
    fp8_param: bool = False
    fp8_quantizer_factory: Optional[str] = None
    fp8_interval: int = 1
    fp8_wgrad: bool = True
    fp8_output_proj: bool = False
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    tp_only_amax_red: bool = False
    use_kitchen: bool = False
    use_kitchen_attention: bool = False
    kitchen_attention_backend: Any = 'sdpa'
    fp4: Any = None
    fp4_recipe: Any = 'nvfp4'
    fp4_param: bool = False
    fp4_quantizer_factory: Optional[str] = None
    high_priority_a2a_comm_stream: bool = False
    use_grouped_gemm_for_shared_expert: bool = False
    moe_shared_expert_glu_interleave_size: Optional[int] = None
    moe_enable_routing_replay: bool = False
    moe_router_topk_limited_devices: Optional[int] = None
    moe_router_padding_for_quantization: Optional[bool] = False
    moe_router_padding_for_fp8: Optional[bool] = False
    moe_router_quantile_balancing_ema: float = 0.0
    use_grouped_gemm_for_dense_mlp: bool = False
    moe_single_grouped_weight: bool = False
    moe_single_grouped_bias: bool = False
    moe_token_dropping: bool = False
    moe_enable_deepep: bool = False
    moe_flex_dispatcher_backend: Any = 'deepep'
    moe_permute_fusion_into_hybridep: bool = False
    moe_hybridep_pad_uneven_dispatch_inputs: bool = False
    moe_pad_experts_for_cuda_graph_inference: bool = False
    moe_layer_recompute: bool = False
    moe_flex_dispatcher_num_sms: Optional[int] = None
    moe_deepep_num_sms: Optional[int] = None
    moe_hybridep_num_sms: Optional[int] = None
    moe_hybridep_num_blocks_permute: Optional[int] = None
    moe_hybridep_num_blocks_unpermute: Optional[int] = None
    moe_hybridep_num_sms_preprocessing: int = 108
    moe_ncclep_static_shape: bool = False
    moe_ncclep_zero_copy: bool = False
    moe_mlp_glu_interleave_size: Optional[int] = None
    moe_expert_rank_capacity_factor: Optional[float] = None
    enable_cuda_graph: bool = False
    cuda_graph_use_single_mempool: bool = True
    cuda_graph_retain_backward_graph: bool = False
    cuda_graph_warmup_steps: int = 3
    external_cuda_graph: bool = False
    cuda_graph_impl: Any = 'none'
    cuda_graph_modules: Any = 'full'
    inference_cuda_graph_scope: Any = None
    cuda_graph_scope: Any = None
    clone_scatter_output_in_embedding: bool = True
    disable_parameter_transpose_cache: bool = False
    config_logger_dir: str = ''
    flash_decode: bool = False
    batch_invariant_mode: bool = False
    use_te_activation_func: bool = False
    use_te_rng_tracker: bool = False
    inference_rng_tracker: bool = False
    inference_sampling_seed: int = 42
    symmetric_ar_type: Any = None
    nccl_all_reduce_for_prefill: bool = False
    use_inference_optimized_layers: bool = False
    inference_fuse_tp_communication: bool = False
    inference_disable_triton_nvls_kernels: bool = False
    inference_grouped_gemm_backend: Any = 'vllm'
    inference_moe_disable_fused_quant_kernels: bool = False
    inference_moe_token_dispatcher_type: Any = 'nvls'
    mamba_training_ssm_states_dtype: Optional[torch.dtype] = None
    use_mamba_mem_eff_path: bool = True
    mlp_chunks_for_prefill: int = 1
    mlp_chunks_for_training: int = 1
    heterogeneous_block_specs: bool = False
    hetereogenous_dist_checkpoint: bool = False
    quant_recipe: Any = None
    transformer_impl: Any = 'transformer_engine'
    fine_grained_activation_offloading: bool = False
    offload_modules: Optional[list[str]] = field(default_factory=list)
    min_offloaded_tensor_size: int = 1024 * 1024
    delay_offload_until_cuda_graph: bool = False
    delta_offload_bytes_across_pp_ranks: int = 0
    activation_offload_fraction: float = 1.0
    moe_paged_stash: bool = False
    moe_paged_stash_page_size: int = 64
    moe_paged_stash_buffer_size_factor_cuda: float = 1.1
    moe_paged_stash_buffer_size_factor_cpu: float = 0.0
    fine_grained_offloading_max_inflight_offloads: Optional[int] = None
