"""Megatron-only names of ``megatron.core.utils``, reached through its lazy alias table.

Decorators nothing here calls, version probes of packages this project does not use, Megatron's TP
batch broadcast and packed-batch flattening, DTensor and process-group helpers, NVTX ranges, a disabled
StragglerDetector, and the Megatron signatures of helpers whose working versions live elsewhere
(``tensor_parallel.weight_grad``, ``transformer.sharded_state``, ``context_parallel.utils``).
"""
import asyncio
import contextlib
import functools
import inspect
import logging
import math
import operator
import warnings
from functools import reduce
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Any, Callable, Dict, List, Optional

import torch
from packaging.version import Version
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.config import is_experimental_enabled
from megatron.core.context_parallel.utils import get_batch_on_this_cp_rank as _on_cp_rank
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed.param_hashes import param_hashes_match_across_dp
from megatron.core.tensor_parallel.weight_grad import (  # noqa: F401  (Megatron's path: megatron.core.utils)
    drain_embedding_wgrad_compute,
    prepare_input_tensors_for_wgrad_compute,
)
from megatron.core.transformer.sharded_state import (  # noqa: F401  (Megatron's path: megatron.core.utils)
    checkpoint_groups,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron.core.utils import get_attr_wrapped_model, get_device, get_pg_rank

logger = logging.getLogger(__name__)


def get_current_device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def ensure_divisibility(numerator: int, denominator: int) -> None:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def prod(values) -> int:
    return reduce(operator.mul, values, 1)


def get_tensor_list(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return [t for t in tensors if t is not None]


def _version(dist_name: str, missing_ok: bool):
    """Installed version of a distribution; 0.0.0 when absent and `missing_ok` (as Megatron for TE)."""
    try:
        return Version(_dist_version(dist_name))
    except PackageNotFoundError:
        if missing_ok:
            return Version("0.0.0")
        raise ImportError(f"{dist_name} is not installed")


def _at_least(current, wanted: str, check_equality: bool) -> bool:
    return current >= Version(wanted) if check_equality else current > Version(wanted)


def get_torch_version():
    return Version(torch.__version__.split("+")[0])


def is_torch_min_version(version, check_equality=True) -> bool:
    return _at_least(get_torch_version(), version, check_equality)


def get_te_version():
    """Transformer Engine's version, 0.0.0 without it (no code path here needs it)."""
    return _version("transformer-engine", missing_ok=True)


def is_te_min_version(version, check_equality=True) -> bool:
    return _at_least(get_te_version(), version, check_equality)


def get_fa_version():
    return _version("flash-attn", missing_ok=False)


def is_fa_min_version(version, check_equality=True) -> bool:
    return _at_least(get_fa_version(), version, check_equality)


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def log_single_rank(logger, *args, rank: int = 0, **kwargs) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == rank:
        logger.log(*args, **kwargs)


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
            with (mem_alloc_context or contextlib.nullcontext)():
                buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device=get_device())
        return buf[:numel].view(*tensor_shape)


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


# ---- process groups ----------------------------------------------------------------------------------------------

def get_pg_src_rank(group=None):
    """Global rank of the group's first member."""
    if not torch.distributed.is_initialized() or group is None:
        return 0
    return torch.distributed.get_process_group_ranks(group)[0]


def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
    """`tp_group`, or parallel_state's (expert) tensor-parallel group when it is None."""
    if tp_group is not None or not torch.distributed.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def log_on_each_pipeline_stage(logger, *args, tp_group=None, dp_cp_group=None, **kwargs):
    """logger.log(...) on the first TP and DP rank of every pipeline stage."""
    tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
    dp_cp_group = dp_cp_group or parallel_state.get_data_parallel_group(with_context_parallel=True)
    if get_pg_rank(tp_group) == 0 and get_pg_rank(dp_cp_group) == 0:
        logger.log(*args, **kwargs)


def check_param_hashes_across_dp_replicas(model, cross_check=False):
    """True when every parameter is bit-identical across its data-parallel replicas (SHA-1 per parameter, expert
    parameters over the expert data-parallel group); every rank gets the same answer. ``cross_check`` is
    accepted for Megatron's signature: every replica is compared with every other either way."""
    return param_hashes_match_across_dp(model)[0]


# ---- DTensor (torch FSDP2) -----------------------------------------------------------------------

def _is_dtensor(tensor):
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


# ---- checkpoint sharding helpers ---------------------------------------------------------------------------------

def make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets=(), replica_id=None, **kwargs):
    """ShardedTensor of a tensor replicated over TP and DP (TP and DP ranks > 0 are replicas)."""
    tp_group, dp_cp_group = checkpoint_groups(kwargs)
    if replica_id is None:
        replica_id = (0, get_pg_rank(tp_group), get_pg_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets, replica_id=replica_id,
                                           prepend_axis_num=len(prepend_offsets), **kwargs)


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


# ---- batches -----------------------------------------------------------------------------------------------------

def get_batch_on_this_cp_rank(batch, is_hybrid_cp: bool = False, cp_group=None, hybrid_cp_group_func=None,
                              use_per_sequence_balancing: bool = False):
    """Megatron's signature for megatron.core.context_parallel.get_batch_on_this_cp_rank: this CP rank's
    load-balanced chunks of every [b, s] tensor of ``batch`` (over ``cp_group``, default the CP group)."""
    if is_hybrid_cp or hybrid_cp_group_func is not None or use_per_sequence_balancing:
        raise NotImplementedError("get_batch_on_this_cp_rank: hybrid CP and per-sequence balancing are not "
                                  "supported; leave is_hybrid_cp / hybrid_cp_group_func / "
                                  "use_per_sequence_balancing at their defaults")
    if cp_group is None:
        return _on_cp_rank(batch)
    return _on_cp_rank(batch, torch.distributed.get_world_size(cp_group), torch.distributed.get_rank(cp_group))


_SEQ_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _stage_keys(pipeline_model_parallel_size, mtp_on_this_rank, is_pipeline_first_stage, is_pipeline_last_stage):
    """Which [b, s] tensors this stage needs: all without PP (or with MTP), inputs on the first stage,
    targets on the last, none in between."""
    if pipeline_model_parallel_size == 1 or mtp_on_this_rank:
        return _SEQ_KEYS
    if is_pipeline_first_stage:
        return ("tokens", "position_ids")
    if is_pipeline_last_stage:
        return ("labels", "loss_mask")
    return ()


def get_batch_on_this_tp_rank(batch, has_cu_seqlens, is_hybrid_cp, create_attention_mask_in_dataloader,
                              broadcast_src_rank, broadcast_group, cp_size, tp_rank, micro_batch_size, seq_length,
                              mtp_on_this_rank, pipeline_model_parallel_size=1, is_pipeline_first_stage=False,
                              is_pipeline_last_stage=False):
    """TP rank 0's batch on every rank of `broadcast_group` (its global rank is `broadcast_src_rank`).

    Rank 0 passes its batch dict ([b, s] int64 tokens/labels/position_ids, float loss_mask, optional bool
    [b, 1, s, s] attention_mask, int32 [b, n] cu_seqlens / cu_seqlens_padded and [b] max_seqlen when
    `has_cu_seqlens`); the others pass anything and get freshly received tensors. Keys a pipeline stage
    does not need come back as None, as in Megatron."""
    if is_hybrid_cp:
        raise NotImplementedError("get_batch_on_this_tp_rank(is_hybrid_cp=True): hybrid context parallelism is "
                                  "not implemented")
    keys = _stage_keys(pipeline_model_parallel_size, mtp_on_this_rank, is_pipeline_first_stage,
                       is_pipeline_last_stage)
    has_mask = create_attention_mask_in_dataloader and bool(keys)
    device = next((t.device for t in (batch or {}).values() if torch.is_tensor(t)), None) or get_device()

    def bcast(t):
        torch.distributed.broadcast(t, broadcast_src_rank, group=broadcast_group)
        return t

    def bcast_cu_seqlens(t):  # length first: receivers cannot know how many offsets a sample has
        n = bcast(torch.tensor(0 if t is None else t.numel(), dtype=torch.int64, device=device)).item()
        if n == 0:
            return None
        if t is None:
            t = torch.empty((micro_batch_size, n // micro_batch_size), dtype=torch.int32, device=device)
        return bcast(t)

    out = {k: None for k in _SEQ_KEYS + ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen",
                                         "local_cp_size", "hybrid_cp_group")}
    src = tp_rank == 0
    shape = (micro_batch_size, seq_length)
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32, "position_ids": torch.int64}
    for k in keys:
        out[k] = bcast(batch[k].contiguous() if src else torch.empty(shape, dtype=dtypes[k], device=device))
    if has_cu_seqlens:
        out["cu_seqlens"] = bcast_cu_seqlens(batch["cu_seqlens"] if src else None)
        out["max_seqlen"] = bcast(batch["max_seqlen"] if src else
                                  torch.empty(micro_batch_size, dtype=torch.int32, device=device))
        if cp_size > 1:
            out["cu_seqlens_padded"] = bcast_cu_seqlens(batch["cu_seqlens_padded"] if src else None)
    if has_mask:
        out["attention_mask"] = bcast(batch["attention_mask"] if src else torch.empty(
            (micro_batch_size, 1, seq_length, seq_length), dtype=torch.bool, device=device))
    if src:  # rank 0 keeps its own dict, with the unneeded keys dropped
        batch = dict(batch)
        batch.update({k: None for k in _SEQ_KEYS if k not in keys})
        return batch
    return out


def _merge_cu_seqlens(cu_seqlens, seq_length):
    """[b, n] per-sample offsets (each row 0 .. seq_length, right-padded with seq_length) -> one 1-D
    offset list over the b * seq_length concatenated tokens."""
    parts = []
    for i, row in enumerate(cu_seqlens):
        hits = (row == seq_length).nonzero(as_tuple=True)[0]
        row = row[:hits[0].item() + 1] if hits.numel() else row
        parts.append(row if i == 0 else row[1:] + i * seq_length)
    return torch.cat(parts)


def flatten_batch_for_packed_sequences(batch: Dict[str, Any]) -> Dict[str, Any]:
    """A packed micro-batch of b samples as one sample of b * s tokens, the layout THD attention takes:
    [b, s] tensors -> [1, b*s], cu_seqlens (and cu_seqlens_padded) merged into [1, n], max_seqlen -> its max.
    A batch without cu_seqlens is returned unchanged."""
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        return batch
    present = [batch[k] for k in _SEQ_KEYS if batch.get(k) is not None]
    seq_length = present[0].shape[1] if present else int(cu_seqlens[0, -1])
    batch["cu_seqlens"] = _merge_cu_seqlens(cu_seqlens, seq_length).unsqueeze(0)
    if batch.get("cu_seqlens_padded") is not None:
        batch["cu_seqlens_padded"] = _merge_cu_seqlens(batch["cu_seqlens_padded"], seq_length).unsqueeze(0)
    if batch.get("max_seqlen") is not None:
        batch["max_seqlen"] = batch["max_seqlen"].max().unsqueeze(0)
    for k in _SEQ_KEYS:
        if batch.get(k) is not None:
            batch[k] = batch[k].reshape(1, -1)
    return batch


class StragglerDetector:
    """Megatron's per-rank straggler timer, in its default disabled state.

    Megatron's ``pretrain_gpt.py`` creates one at import (``stimer = StragglerDetector()``) and times
    ``with stimer:`` / ``with stimer(bdata=True):`` blocks; until ``configure(..., enabled=True)`` (from
    --log-straggler) those blocks time nothing there either. Enabling it is refused: the CUDA-event
    timing reports are not implemented here.
    """

    def __init__(self):
        self.enabled = False

    def configure(self, world: int, rank: int, mmcnt: int = 1, amp: float = 3.0, port: int = 65535,
                  prefill: int = 1024, enabled: bool = False) -> None:
        if enabled:
            raise NotImplementedError("StragglerDetector (--log-straggler) timing reports are not implemented")

    def __call__(self, bdata: bool = False) -> "StragglerDetector":
        return self

    def __enter__(self) -> "StragglerDetector":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def report(self, total_flops: float = 0.0, log_interval: int = 0) -> bool:
        """False: nothing was reported (the detector is disabled), as Megatron returns when disabled."""
        return False
