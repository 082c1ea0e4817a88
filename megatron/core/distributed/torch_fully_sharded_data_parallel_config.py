"""DistributedDataParallelConfig for torch FSDP2 (TorchFullyShardedDataParallel, --use-torch-fsdp2)."""
from dataclasses import dataclass
from typing import Union

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig


@dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    reshard_after_forward: Union[bool, int] = True
    """torch's fully_shard(reshard_after_forward=...): free gathered params after each layer's forward
    (True, ZeRO-3), keep them until backward (False, ZeRO-2), or reshard to a group of that size (int)."""
