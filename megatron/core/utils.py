"""Small helpers shared across megatron.core: devices, exact division, model unwrapping, viewless tensors.

A leaf: it imports nothing from ``megatron``, so every module can use it. The Megatron-only names of
this module (decorators, version probes, Megatron's batch helpers ...) live in ``megatron/core/_compat/
utils.py`` and resolve through the alias table at the bottom, so ``from megatron.core.utils import X``
keeps working for Megatron code.
"""
import importlib
import os
import sys
from typing import Any, Optional

import torch


def lazy_names(host: str, table: dict):
    """A PEP 562 module ``__getattr__`` for ``host`` that resolves each name in ``table`` on first use.

    ``table`` maps an attribute name to the module that defines it (``{"name": "megatron.core._compat.x"}``).
    This is how Megatron's import paths reach the compatibility rooms (``megatron/*/_compat/``) without a
    working module importing them: the room is imported only when a user's code asks for one of its
    names. The resolved value is cached on the host module.
    """

    def __getattr__(name: str):
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {host!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(target), name)
        setattr(sys.modules[host], name, value)
        return value

    return __getattr__


def get_device(local_rank: Optional[int] = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    return torch.device(f"cuda:{local_rank}")


def device_synchronize() -> None:
    """Wait for the work queued on this rank's GPU (nothing to wait for on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; raises if ``denominator`` does not divide ``numerator``."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def get_pg_size(group=None) -> int:
    """Size of `group` (1 without torch.distributed or group)."""
    if not torch.distributed.is_initialized() or group is None:
        return 1
    return group.size()


def get_pg_rank(group=None) -> int:
    """This process's rank in `group` (0 without torch.distributed or group)."""
    if not torch.distributed.is_initialized() or group is None:
        return 0
    return group.rank()


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """Walk ``.module`` wrappers (DDP, Float16Module) until one has ``attr``."""
    if isinstance(model, list):
        raise TypeError("get_attr_wrapped_model expects a single model chunk, not a list")
    while not hasattr(model, attr):
        if not hasattr(model, "module"):
            raise RuntimeError(f"no wrapped module has attribute '{attr}'")
        model = model.module
    if return_model_obj:
        return model
    value = getattr(model, attr)
    if value is None and not allow_none:
        raise RuntimeError(f"attribute '{attr}' is None")
    return value


def get_model_config(model):
    """The TransformerConfig of a (possibly wrapped) model chunk."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def unwrap_model(model, module_instances: Any = None):
    """Strip wrapper modules (anything exposing ``.module``) from a model or list of models."""
    models = model if isinstance(model, list) else [model]
    out = []
    for m in models:
        while hasattr(m, "module") and (module_instances is None or isinstance(m, module_instances)):
            m = m.module
        out.append(m)
    return out if isinstance(model, list) else out[0]


class MakeViewlessTensor(torch.autograd.Function):
    """Identity whose output owns no ``_base``, keeping the autograd graph."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
        out.data = inp.data
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """A tensor that is not a view, so a pipeline stage can free its output storage after sending it."""
    if inp._base is None:
        return inp
    if keep_graph:
        return MakeViewlessTensor.apply(inp, requires_grad)
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


def init_method_normal(sigma: float):
    """N(0, sigma) initializer."""
    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """N(0, sigma / sqrt(multiplier * num_layers)) for output projections of residual branches."""
    std = sigma / (multiplier * num_layers) ** 0.5
    return init_method_normal(std)


_COMPAT = "megatron.core._compat.utils"
__getattr__ = lazy_names(__name__, {
    "ExperimentalNotEnabledError": _COMPAT, "GlobalMemoryBuffer": _COMPAT, "StragglerDetector": _COMPAT,
    "WrappedTensor": _COMPAT, "accepts_parameter": _COMPAT, "assert_viewless_tensor": _COMPAT,
    "check_param_hashes_across_dp_replicas": _COMPAT, "configure_nvtx_profiling": _COMPAT,
    "deprecate_args": _COMPAT, "deprecate_inference_params": _COMPAT, "deprecated": _COMPAT,
    "drain_embedding_wgrad_compute": _COMPAT, "ensure_divisibility": _COMPAT, "experimental_api": _COMPAT,
    "experimental_cls": _COMPAT, "experimental_fn": _COMPAT, "flatten_batch_for_packed_sequences": _COMPAT,
    "get_asyncio_loop": _COMPAT, "get_batch_on_this_cp_rank": _COMPAT, "get_batch_on_this_tp_rank": _COMPAT,
    "get_causal_conv1d_version": _COMPAT, "get_current_device_type": _COMPAT,
    "get_data_parallel_group_if_dtensor": _COMPAT, "get_fa_version": _COMPAT, "get_flashinfer_version": _COMPAT,
    "get_full_tensor_if_necessary": _COMPAT, "get_mamba_version": _COMPAT, "get_model_type": _COMPAT,
    "get_model_xattn": _COMPAT, "get_pg_src_rank": _COMPAT, "get_te_version": _COMPAT, "get_tensor_list": _COMPAT,
    "get_tensor_model_parallel_group_if_none": _COMPAT, "get_torch_version": _COMPAT, "internal_api": _COMPAT,
    "is_causal_conv1d_min_version": _COMPAT, "is_fa_min_version": _COMPAT, "is_flashinfer_min_version": _COMPAT,
    "is_mamba_min_version": _COMPAT, "is_submodule": _COMPAT, "is_te_min_version": _COMPAT,
    "is_torch_min_version": _COMPAT, "is_using_quantization_scales": _COMPAT, "local_multi_tensor_applier": _COMPAT,
    "local_multi_tensor_l2_norm": _COMPAT, "local_multi_tensor_scale": _COMPAT,
    "log_on_each_pipeline_stage": _COMPAT, "log_single_rank": _COMPAT,
    "make_sharded_tensor_for_checkpoint": _COMPAT, "make_tp_sharded_tensor_for_checkpoint": _COMPAT,
    "mup_scaled_init_method_normal": _COMPAT, "null_decorator": _COMPAT, "nvtx_decorator": _COMPAT,
    "nvtx_range_pop": _COMPAT, "nvtx_range_push": _COMPAT, "prepare_input_tensors_for_wgrad_compute": _COMPAT,
    "print_rank_0": _COMPAT, "prod": _COMPAT, "round_up_to_nearest_multiple": _COMPAT,
    "safely_set_viewless_tensor_data": _COMPAT, "to_local_if_dtensor": _COMPAT, "trace_async_exceptions": _COMPAT,
})
