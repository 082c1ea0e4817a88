"""Data parallelism: DDP with contiguous bucketed grad buffers, grad finalization, torch FSDP2."""
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fully_sharded_data_parallel import FullyShardedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig

__all__ = ["DistributedDataParallel", "FullyShardedDataParallel", "DistributedDataParallelConfig",
           "finalize_model_grads", "TorchFullyShardedDataParallel", "TorchFullyShardedDataParallelConfig"]
