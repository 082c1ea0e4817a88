"""Configuration of the data-parallel engine (Megatron Core's `DistributedDataParallelConfig`)."""
from dataclasses import dataclass
from typing import Optional

from megatron.core._compat_fields import check_compat_fields
from megatron.core.distributed._compat_fields import DistributedDataParallelConfigCompat


@dataclass
class DistributedDataParallelConfig(DistributedDataParallelConfigCompat):
    grad_reduce_in_fp32: bool = False
    """Keep `main_grad` buffers and the gradient collectives in fp32 (bf16/fp16 models)."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's collective from the backward hooks as soon as the bucket is complete."""

    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather updated params asynchronously, waited on in forward pre-hooks."""

    align_param_gather: bool = False
    """Accepted for Megatron compatibility; bucket all-gathers are always dispatched in bucket order here."""

    use_distributed_optimizer: bool = False
    """Reduce-scatter grads (each DP rank owns 1/DP of each bucket) instead of all-reducing them."""

    num_distributed_optimizer_instances: int = 1
    """Replicas of the distributed optimizer's state: each shards it over 1/N of the DP group (HSDP-like); the
    groups come from initialize_model_parallel(num_distributed_optimizer_instances=N)."""

    check_for_nan_in_grad: bool = False
    """Raise before communication if a bucket holds a NaN/Inf gradient."""

    check_for_large_grads: bool = False
    """Megatron checks each bucket; here the training step validates the rank's grad norm through the rerun
    state machine (megatron/training/train_step.py), so DDP itself does nothing with it."""

    bucket_size: Optional[int] = None
    """Params per bucket; None = max(40M, 1M * DP) when overlapping the grad reduce, else one bucket."""

    num_buckets: Optional[int] = None
    """Instead of ``bucket_size``: about this many buckets, ``bucket_size`` = the wrapped module's params //
    ``num_buckets`` (the training loop divides all of a rank's model chunks, as Megatron does)."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Accepted for Megatron compatibility; buckets are padded only to a multiple of the DP size."""

    average_in_collective: bool = False
    """Average in the collective (ReduceOp.AVG) instead of pre-scaling grads by 1/DP."""

    fp8_param_gather: bool = False
    """FP8 params are not supported; only `False` is accepted."""

    use_custom_fsdp: bool = False
    """Megatron FSDP is not supported (use torch FSDP2: `--use-torch-fsdp2`)."""

    use_megatron_fsdp: bool = False
    """Set by Megatron-FSDP code next to wrapping the model in FullyShardedDataParallel; no effect on the
    config itself (DistributedDataParallel ignores it, as in Megatron)."""

    data_parallel_sharding_strategy: str = "no_shard"
    """What FullyShardedDataParallel shards: no_shard, optim, optim_grads, optim_grads_params (ZeRO 0-3);
    DistributedDataParallel ignores it, as in Megatron."""

    def __post_init__(self):
        check_compat_fields(self, DistributedDataParallelConfigCompat)
        if self.num_distributed_optimizer_instances < 1:
            raise ValueError("--num-distributed-optimizer-instances must be >= 1")
        if self.num_distributed_optimizer_instances > 1 and not self.use_distributed_optimizer:
            raise ValueError("--num-distributed-optimizer-instances > 1 requires --use-distributed-optimizer")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather requires --use-distributed-optimizer")
        if self.fp8_param_gather:
            raise NotImplementedError("--fp8-param-gather is not supported; drop the flag")
        if self.use_custom_fsdp:
            raise NotImplementedError("--use-megatron-fsdp is not supported; use --use-torch-fsdp2")
        strategies = ("no_shard", "optim", "optim_grads", "optim_grads_params")
        if self.data_parallel_sharding_strategy not in strategies:
            raise ValueError(f"--data-parallel-sharding-strategy {self.data_parallel_sharding_strategy!r}: use one "
                             f"of {', '.join(strategies)}")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError("--ddp-bucket-size must be a positive number of parameters")
        if self.num_buckets is not None:
            if self.bucket_size is not None:
                raise ValueError("--ddp-num-buckets and --ddp-bucket-size both size the buckets; pass one")
            if self.num_buckets <= 0:
                raise ValueError(f"--ddp-num-buckets ({self.num_buckets}) must be > 0")
