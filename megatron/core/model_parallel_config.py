"""Parallelism and precision settings shared by every Megatron Core module."""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.core._compat_fields import ModelParallelConfigCompat, check_compat_fields
from megatron.core.utils import lazy_names

# Megatron's weight-shard resolver (weight rematerialisation is not built), resolved on first use.
__getattr__ = lazy_names(__name__, {
    "resolve_tensor_parallel_weight_shards": "megatron.core._compat.model_parallel_config"})


@dataclass
class ModelParallelConfig(ModelParallelConfigCompat):
    """Degrees of parallelism, dtypes and the training-loop hooks the schedules call."""

    # Model parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    # CP split in levels, [all-to-all size, ring size] for --cp-comm-type a2a+p2p (product = context_parallel_size)
    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None

    # Initialization
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    seed: int = 1234  # drives layout-independent parameter init

    # Precision
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    enable_autocast: bool = False  # the schedules run each forward step under torch.autocast(autocast_dtype)
    autocast_dtype: Optional[torch.dtype] = None
    timers: Optional[Callable] = None

    # Training-loop hooks read by the schedules
    finalize_model_grads_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None

    # Pipeline
    pipeline_dtype: Optional[torch.dtype] = None
    variable_seq_lengths: bool = False
    deallocate_pipeline_outputs: bool = False
    batch_p2p_comm: bool = True
    # Interleaved schedule: post each direction's exchange asynchronously and wait only where the tensors
    # are needed (steady-state calls; warm-up and flush calls too with overlap_p2p_comm_warmup_flush).
    overlap_p2p_comm: bool = False
    overlap_p2p_comm_warmup_flush: bool = False
    microbatch_group_size_per_vp_stage: Optional[int] = None
    # --defer-embedding-wgrad-compute: the last stage's output-layer weight-gradient GEMMs wait in buffers
    # (GPTModel.embedding_activation_buffer / grad_output_buffer) until its last backward has sent its input
    # gradient upstream, then run at the end of the step while the earlier stages finish their backward
    # (tensor_parallel/deferred_wgrad.py). wgrad_deferral_limit: defer only the first N output-layer calls of
    # a step (0: all), bounding the buffered activations' memory.
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0

    # Performance
    gradient_accumulation_fusion: bool = False
    barrier_with_L1_time: bool = True
    async_tensor_model_parallel_allreduce: bool = False
    # TP communication overlap (our chunked ring over torch.distributed; see tensor_parallel/overlap.py)
    tp_comm_overlap: bool = False
    tp_comm_overlap_ag: bool = True  # all-gathers: column-parallel forward, row-parallel backward
    tp_comm_overlap_rs: bool = True  # reduce-scatter of the row-parallel forward
    tp_comm_bulk_dgrad: bool = True  # column backward: re-gather of X behind the dX GEMM
    tp_comm_bulk_wgrad: bool = True  # column backward: dX reduce-scatter behind the wgrad GEMM
    # MoE expert-parallel overlap (see docs/moe.md): the next micro-batch's forward beside this one's
    # backward (pipeline_parallel/combined_1f1b.py), and the experts' weight gradients computed while the
    # backward dispatch all-to-all is in flight (transformer/moe/delayed_wgrad.py).
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    # --cpu-offloading-num-layers N: the first N layers keep the tensors saved for their backward in host memory
    # (transformer/activation_offload.py; TransformerConfig checks N against the layers). cpu_offloading is set
    # from N > 0, as Megatron's training does.
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    cpu_offloading_activations: bool = True

    def __post_init__(self):
        check_compat_fields(self, ModelParallelConfigCompat)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are exclusive: set only one of --fp16 / --bf16")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # Megatron silently turns SP off at TP=1; SP over one rank is the identity.
            self.sequence_parallel = False
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size
        if self.overlap_p2p_comm_warmup_flush and not self.overlap_p2p_comm:
            raise ValueError("overlap_p2p_comm_warmup_flush (--overlap-p2p-communication-warmup-flush) extends "
                             "overlap_p2p_comm to warm-up and flush: drop --no-overlap-p2p-communication")
        if self.defer_embedding_wgrad_compute:
            if self.pipeline_model_parallel_size == 1:
                raise ValueError("defer_embedding_wgrad_compute (--defer-embedding-wgrad-compute) hides the output "
                                 "layer's weight gradient behind the pipeline flush: it needs "
                                 "pipeline_model_parallel_size > 1")
            if not self.gradient_accumulation_fusion:
                raise ValueError("defer_embedding_wgrad_compute (--defer-embedding-wgrad-compute) adds the deferred "
                                 "weight gradients straight into main_grad: it needs gradient_accumulation_fusion "
                                 "(drop --no-gradient-accumulation-fusion)")
        if self.wgrad_deferral_limit < 0:
            raise ValueError(f"wgrad_deferral_limit (--wgrad-deferral-limit) must be >= 0 (0: defer every "
                             f"output-layer call), got {self.wgrad_deferral_limit}")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("tp_comm_overlap (--tp-comm-overlap) overlaps the sequence-parallel communication: "
                             "it needs sequence_parallel and tensor_model_parallel_size > 1")
