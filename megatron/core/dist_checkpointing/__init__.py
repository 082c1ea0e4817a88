"""Layout-independent checkpoints: sharded state dicts saved and loaded through torch.distributed.checkpoint."""
from .core import CheckpointingException, check_is_distributed_checkpoint
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)
from .serialization import (
    fp8_extra_state_key,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
    save_in_megatron_layout,
    staged_bytes,
)
from .strategies.async_utils import AsyncCallsQueue, AsyncRequest

__all__ = ["ShardedTensor", "ShardedObject", "ShardedTensorFactory", "ShardedStateDict", "save", "load",
           "load_common_state_dict", "load_tensors_metadata", "load_sharded_metadata", "load_plain_tensors",
           "load_content_metadata", "remove_sharded_tensors", "ShardedBase", "check_is_distributed_checkpoint",
           "CheckpointingException", "AsyncCallsQueue", "AsyncRequest", "save_in_megatron_layout",
           "fp8_extra_state_key", "staged_bytes"]
