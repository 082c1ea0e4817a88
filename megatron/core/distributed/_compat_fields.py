"""DistributedDataParallelConfig fields of Megatron Core 0.19.2 without a counterpart here, at Megatron's defaults
(accepted there, refused elsewhere: see megatron/core/_compat_fields.py)."""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass
class DistributedDataParallelConfigCompat:
    """DistributedDataParallelConfig fields of Megatron Core 0.19.2 that have no counterpart here."""

    reduce_scatter_with_fp32_accumulation: bool = False
    param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = ()
    fp4_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int = None
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    fsdp_all_gather_in_start_param_sync: bool = True
    outer_dp_sharding_strategy: str = 'no_shard'
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    delay_wgrad_compute: bool = False
    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = torch.float32
    megatron_fsdp_main_grads_dtype: Optional[torch.dtype] = None
    megatron_fsdp_grad_comm_dtype: Optional[torch.dtype] = None
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False
