"""Megatron Core: the library. Top-level names resolve lazily (PEP 562) so that importing any
submodule stays cheap and free of import cycles; `mpu` is parallel_state's legacy name."""
import importlib

_SUBMODULES = ("parallel_state", "tensor_parallel", "utils")
_NAMES = {
    "mpu": ("megatron.core.parallel_state", None),
    "DistributedDataParallel": ("megatron.core.distributed", "DistributedDataParallel"),
    "ModelParallelConfig": ("megatron.core.model_parallel_config", "ModelParallelConfig"),
    "Timers": ("megatron.core.timers", "Timers"),
    "is_torch_min_version": ("megatron.core.utils", "is_torch_min_version"),
    "register_safe_globals": ("megatron.core.safe_globals", "register_safe_globals"),
    "safe_load_from_bytes": ("megatron.core.safe_globals", "safe_load_from_bytes"),
}
__all__ = list(_SUBMODULES) + list(_NAMES)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"megatron.core.{name}")
    if name in _NAMES:
        module, attr = _NAMES[name]
        module = importlib.import_module(module)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'megatron.core' has no attribute '{name}'")
