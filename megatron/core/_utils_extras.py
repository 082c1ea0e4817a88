"""Less common megatron.core.utils names: decorators, process-group and DTensor helpers, viewless
tensors, NVTX ranges, checkpoint sharding helpers (re-exported by megatron/core/utils.py)."""
import asyncio
import functools
import inspect
import logging
import math
import warnings
from typing import Callable, Optional

import torch

from megatron.core.utils import _at_least, _version, get_attr_wrapped_model

logger = logging.getLogger(__name__)
__all__ = [
    "ExperimentalNotEnabledError", "GlobalMemoryBuffer", "WrappedTensor",
    "accepts_parameter", "assert_viewless_tensor", "safely_set_viewless_tensor_data",
    "check_param_hashes_across_dp_replicas", "configure_nvtx_profiling", "nvtx_decorator", "nvtx_range_push",
    "nvtx_range_pop", "deprecate_args", "deprecated", "deprecate_inference_params", "experimental_api",
    "experimental_cls", "experimental_fn", "internal_api", "null_decorator", "get_asyncio_loop",
    "trace_async_exceptions", "get_data_parallel_group_if_dtensor", "to_local_if_dtensor",
    "get_full_tensor_if_necessary", "get_model_type", "get_model_xattn", "get_pg_rank", "get_pg_size",
    "get_pg_src_rank", "get_tensor_model_parallel_group_if_none", "is_submodule", "is_using_quantization_scales",
    "local_multi_tensor_applier", "local_multi_tensor_l2_norm", "local_multi_tensor_scale",
    "log_on_each_pipeline_stage", "make_sharded_tensor_for_checkpoint", "make_tp_sharded_tensor_for_checkpoint",
    "mup_scaled_init_method_normal", "round_up_to_nearest_multiple", "get_mamba_version",
    "is_mamba_min_version", "get_causal_conv1d_version", "is_causal_conv1d_min_version",
    "get_flashinfer_version", "is_flashinfer_min_version",
]


class ExperimentalNotEnabledError(Exception):
    """An experimental API was called without megatron.core.config.set_experimental_flag(True)."""


class GlobalMemoryBuffer:
    """Reusable scratch tensors keyed by (name, dtype); callers must not use one name concurrently."""

    def __init__(self):
        self.buffer = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Optional[Callable] = None):
        numel = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < numel:
            from megatron.core.utils import get_device
            with (mem_alloc_context or _nullcontext)():
                buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device=get_device())
        return buf[:numel].view(*tensor_shape)


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


class WrappedTensor:
    """Holds a tensor so that a callee can take it and drop the caller's reference (frees memory early)."""

    def __init__(self, tensor: torch.Tensor):
        self._wrapper = [tensor]

    def unwrap(self):
        """The tensor; the wrapper lets go of it."""
        return self._wrapper.pop()


def assert_viewless_tensor(tensor, extra_msg=None):
    """Assert that a tensor (or each tensor of a list) is not a view of another tensor."""
    if isinstance(tensor, list):
        return [assert_viewless_tensor(t, extra_msg) for t in tensor]
    if isinstance(tensor, torch.Tensor):
        assert tensor._base is None, f"tensor is a view (._base is set); {extra_msg or ''}"
    return tensor


def safely_set_viewless_tensor_data(tensor, new_data_tensor):
    """tensor.data = new_data_tensor, after checking that `tensor` is not a view."""
    assert_viewless_tensor(tensor, extra_msg=f"setting .data of a {tuple(tensor.shape)} tensor")
    tensor.data = new_data_tensor


def accepts_parameter(func, name):
    """Whether `func` takes a parameter called `name`."""
    return name in inspect.signature(func).parameters


def round_up_to_nearest_multiple(value, multiple):
    return ((value + multiple - 1) // multiple) * multiple


def mup_scaled_init_method_normal(sigma, num_layers, width_mult, multiplier=2.0):
    """N(0, sigma / (sqrt(multiplier * num_layers) * sqrt(width_mult))): depth and muP width scaling."""
    std = sigma / (math.sqrt(multiplier * num_layers) * math.sqrt(width_mult))
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)


def is_using_quantization_scales(config):
    return getattr(config, "fp8", False) or getattr(config, "fp4", False)


def get_model_type(model):
    return get_attr_wrapped_model(model, "model_type")


def get_model_xattn(model):
    """Whether the model needs cross-attention inputs (False when it does not say)."""
    try:
        return get_attr_wrapped_model(model, "xattn_needed")
    except RuntimeError:
        return False


def is_submodule(module, parent_module, strict=True):
    """Whether `module` is among `parent_module`'s modules (itself included unless `strict`)."""
    if not strict and module is parent_module:
        return True
    return any(m is module for m in parent_module.modules() if m is not parent_module)


# ---- process groups ------------------------------------------------------------------------------

def get_pg_size(group=None):
    """Size of `group` (1 without torch.distributed or group)."""
    if not torch.distributed.is_initialized() or group is None:
        return 1
    return group.size()


def get_pg_rank(group=None):
    if not torch.distributed.is_initialized() or group is None:
        return 0
    return group.rank()


def get_pg_src_rank(group=None):
    """Global rank of the group's first member."""
    if not torch.distributed.is_initialized() or group is None:
        return 0
    return torch.distributed.get_process_group_ranks(group)[0]


def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
    """`tp_group`, or parallel_state's (expert) tensor-parallel group when it is None."""
    from megatron.core import parallel_state
    if tp_group is not None or not torch.distributed.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def log_on_each_pipeline_stage(logger, *args, tp_group=None, dp_cp_group=None, **kwargs):
    """logger.log(...) on the first TP and DP rank of every pipeline stage."""
    from megatron.core import parallel_state
    tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
    dp_cp_group = dp_cp_group or parallel_state.get_data_parallel_group(with_context_parallel=True)
    if get_pg_rank(tp_group) == 0 and get_pg_rank(dp_cp_group) == 0:
        logger.log(*args, **kwargs)


def check_param_hashes_across_dp_replicas(model, cross_check=False):
    """True when every parameter is bit-identical across data-parallel replicas (all ranks agree).

    Hashes are sums of the raw bytes per parameter (cheap, catches any divergence in practice);
    with `cross_check` every rank compares against every other, else against DP rank 0."""
    from megatron.core import parallel_state
    models = model if isinstance(model, list) else [model]
    params = [p for m in models for p in m.parameters()]
    local = torch.stack([p.detach().contiguous().view(torch.uint8).to(torch.int64).sum().cpu()
                         if p.numel() else torch.zeros((), dtype=torch.int64) for p in params])
    group = parallel_state.get_data_parallel_group()
    if group is None or get_pg_size(group) == 1:
        return True
    device = params[0].device if params else torch.device("cpu")
    gathered = [torch.empty_like(local, device=device) for _ in range(group.size())]
    torch.distributed.all_gather(gathered, local.to(device), group=group)
    references = gathered if cross_check else gathered[:1]
    ok = torch.tensor(int(all(torch.equal(r, g) for r in references for g in gathered)), device=device)
    torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    return bool(ok.item())


# ---- DTensor (torch FSDP2) -----------------------------------------------------------------------

def _is_dtensor(tensor):
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)


def to_local_if_dtensor(tensor):
    """The local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def get_full_tensor_if_necessary(tensor):
    """The gathered full tensor of a DTensor, the tensor itself otherwise."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def get_data_parallel_group_if_dtensor(tensor, data_parallel_group=None):
    """The process group a DTensor is sharded over (checked against `data_parallel_group`), else None."""
    if not _is_dtensor(tensor):
        return None
    group = tensor.device_mesh.get_group()
    assert data_parallel_group is None or group == data_parallel_group, \
        "the DTensor's mesh group is not the given data-parallel group"
    return group


# ---- checkpoint sharding helpers -----------------------------------------------------------------

def _groups(kwargs):
    from megatron.core import parallel_state
    tp_group, dp_cp_group = kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None)
    if tp_group is None and dp_cp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return tp_group, dp_cp_group


def make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets=(), replica_id=None, **kwargs):
    """ShardedTensor of a tensor replicated over TP and DP (TP and DP ranks > 0 are replicas)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    tp_group, dp_cp_group = _groups(kwargs)
    if replica_id is None:
        replica_id = (0, get_pg_rank(tp_group), get_pg_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets, replica_id=replica_id,
                                           prepend_axis_num=len(prepend_offsets), **kwargs)


def make_tp_sharded_tensor_for_checkpoint(tensor, key, tp_axis=0, replica_id=None, prepend_offsets=(),
                                          **kwargs):
    """ShardedTensor of a tensor split along `tp_axis` over TP and replicated over DP."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    tp_group, dp_cp_group = _groups(kwargs)
    axis = tp_axis + len(prepend_offsets)
    if replica_id is None:
        replica_id = (0, 0, get_pg_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets,
                                           (axis, get_pg_rank(tp_group), get_pg_size(tp_group)),
                                           replica_id=replica_id, prepend_axis_num=len(prepend_offsets),
                                           **kwargs)


# ---- fallbacks for apex's multi-tensor kernels ---------------------------------------------------

def local_multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """(global L2 norm of all tensors as a 1-element float tensor, None), like amp_C.multi_tensor_l2norm."""
    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    return total.reshape(1), None


def local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """dst = src * scale for each (src, dst) of tensor_lists[0], tensor_lists[1]."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        dst.copy_(src * scale)


# ---- NVTX ranges (active only after configure_nvtx_profiling(True) on CUDA) -----------------------

_NVTX_ENABLED = False


def configure_nvtx_profiling(enabled: bool):
    global _NVTX_ENABLED
    _NVTX_ENABLED = bool(enabled)


def _nvtx_on():
    return _NVTX_ENABLED and torch.cuda.is_available()


def nvtx_range_push(msg=None, suffix=None):
    if _nvtx_on():
        torch.cuda.nvtx.range_push(f"{msg}.{suffix}" if suffix else str(msg))


def nvtx_range_pop(msg=None, suffix=None):
    if _nvtx_on():
        torch.cuda.nvtx.range_pop()


def nvtx_decorator(message=None):
    """Wrap a function in an NVTX range named `message` (default: the function's name)."""
    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            nvtx_range_push(message or func.__qualname__)
            try:
                return func(*args, **kwargs)
            finally:
                nvtx_range_pop()
        return wrapper
    return decorator


# ---- API lifecycle decorators --------------------------------------------------------------------

def null_decorator(*args, **kwargs):
    """A decorator that changes nothing, usable bare (@null_decorator) or called (@null_decorator(...))."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda func: func


def internal_api(func):
    """Marks `func` as internal (may change without notice); behaviour is unchanged."""
    func._internal_api = True
    return func


def deprecated(version: str, removal_version: Optional[str] = None, alternative: Optional[str] = None,
               reason: Optional[str] = None):
    """Decorator: DeprecationWarning on each call, naming the version, alternative and reason."""
    def decorator(func):
        parts = [f"{func.__name__} is deprecated since version {version}."]
        parts += [f"Use {alternative} instead."] if alternative else []
        parts += [f"Will be removed in version {removal_version}."] if removal_version else []
        parts += [f"Reason: {reason}"] if reason else []

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            warnings.warn(" ".join(parts), DeprecationWarning, stacklevel=2)
            return func(*args, **kwargs)
        wrapper._deprecated = True
        return wrapper
    return decorator


def deprecate_args(*deprecated_keys, message="Argument '{name}' has been deprecated and should not be used."):
    """Decorator: warn when a caller passes any of `deprecated_keys` as keyword arguments."""
    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            for name in set(deprecated_keys) & set(kwargs):
                warnings.warn(message.format(name=name), DeprecationWarning, stacklevel=2)
            return func(*args, **kwargs)
        return wrapper
    return decorator


def deprecate_inference_params(inference_context, inference_params):
    """`inference_params` was renamed `inference_context`: return whichever is given."""
    if inference_context is None and inference_params is not None:
        warnings.warn("`inference_params` is deprecated; pass `inference_context`", DeprecationWarning)
        return inference_params
    return inference_context


def _require_experimental(name):
    from megatron.core.config import is_experimental_enabled
    if not is_experimental_enabled():
        raise ExperimentalNotEnabledError(f"{name} is experimental; call "
                                          "megatron.core.config.set_experimental_flag(True) first")


def experimental_fn(introduced_with_version: str):
    """Decorator: the function raises ExperimentalNotEnabledError unless experimental APIs are on."""
    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            _require_experimental(func.__name__)
            return func(*args, **kwargs)
        return wrapper
    return decorator


def experimental_cls(introduced_with_version: str):
    """Class decorator: constructing the class needs experimental APIs on."""
    def decorator(cls):
        init = cls.__init__

        @functools.wraps(init)
        def checked_init(self, *args, **kwargs):
            _require_experimental(cls.__name__)
            init(self, *args, **kwargs)
        cls.__init__ = checked_init
        return cls
    return decorator


def experimental_api(func):
    """Marks `func` as experimental without gating it (Megatron's bare marker)."""
    func._experimental_api = True
    return func


# ---- asyncio -------------------------------------------------------------------------------------

def get_asyncio_loop(loop=None):
    """`loop`, else the running or current event loop, else a new one set as current."""
    if loop is not None:
        return loop
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop


def trace_async_exceptions(func=None, verbose=False):
    """Decorator for coroutine functions: log an exception with its traceback before re-raising it."""
    def decorator(f):
        @functools.wraps(f)
        async def wrapper(*args, **kwargs):
            try:
                return await f(*args, **kwargs)
            except Exception:
                logger.exception("exception in %s", f.__qualname__)
                raise
        return wrapper
    return decorator(func) if func is not None else decorator


# ---- optional packages' versions (ImportError when absent) ----------------------------------------

def get_mamba_version():
    return _version("mamba-ssm", missing_ok=False)


def is_mamba_min_version(version, check_equality=True):
    return _at_least(get_mamba_version(), version, check_equality)


def get_causal_conv1d_version():
    return _version("causal-conv1d", missing_ok=False)


def is_causal_conv1d_min_version(version, check_equality=True):
    return _at_least(get_causal_conv1d_version(), version, check_equality)


def get_flashinfer_version():
    return _version("flashinfer-python", missing_ok=False)


def is_flashinfer_min_version(version, check_equality=True):
    return _at_least(get_flashinfer_version(), version, check_equality)
