"""Layout-independent checkpoints: sharded state dicts saved and loaded through torch.distributed.checkpoint."""
import importlib as _importlib

from .core import CheckpointingException, check_is_distributed_checkpoint
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

# The save/load entry points stand on torch.distributed.checkpoint, whose import (DTensor and its op tables,
# ~0.6 s) is most of what starting a run costs beyond torch itself. Model code needs only the light
# sharding types above, so those entry points and the async queue resolve on first use.
_LAZY = {name: ".serialization" for name in (
    "fp8_extra_state_key", "load", "load_common_state_dict", "load_content_metadata", "load_plain_tensors",
    "load_sharded_metadata", "load_tensors_metadata", "remove_sharded_tensors", "save", "save_in_megatron_layout",
    "staged_bytes")}
_LAZY.update(AsyncCallsQueue=".strategies.async_utils", AsyncRequest=".strategies.async_utils")


def __getattr__(name: str):
    """A name of ``_LAZY`` from its module, or a submodule (``dist_checkpointing.serialization``), on first use."""
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
    elif not name.startswith("__"):
        try:
            value = _importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = ["ShardedTensor", "ShardedObject", "ShardedTensorFactory", "ShardedStateDict", "save", "load",
           "load_common_state_dict", "load_tensors_metadata", "load_sharded_metadata", "load_plain_tensors",
           "load_content_metadata", "remove_sharded_tensors", "ShardedBase", "check_is_distributed_checkpoint",
           "CheckpointingException", "AsyncCallsQueue", "AsyncRequest", "save_in_megatron_layout",
           "fp8_extra_state_key", "staged_bytes"]
