"""`save` and `load` of sharded state dicts (Megatron Core's `dist_checkpointing` entry points).

A checkpoint directory holds DCP files (`__{rank}_{k}.distcp`, `.metadata`), the non-sharded ("common")
state in `common.pt` (written by rank 0), and `metadata.json`, written last.
"""
import logging
import os
from dataclasses import replace
from typing import Any, Dict, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from megatron.core.transformer.te_key_map import alternative_key, has_fp8_scaling_state
from megatron.core.utils import lazy_names

from . import dict_utils, megatron_layout
from .core import CONFIG_FNAME, CheckpointingException, maybe_load_config, save_config
from .mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_sharded,
)
from .strategies import torch as torch_strategy
from .strategies.async_utils import AsyncRequest
from .strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_main_replicas,
    exchange_loaded,
    plan_parallel_reads,
    shard_id,
)
from .strategies.staging import HostStaging
from .validation import (
    StrictHandling,
    adjust_non_strict_load,
    determine_global_metadata,
    determine_missing_and_unexpected_keys,
    maybe_report_missing_and_unexpected_keys,
    mismatch_message,
    parse_strict_flag,
    save_integrity_manifest,
    sharding_error,
    verify_checkpoint,
    verify_integrity_manifest,
)

# Megatron's default-strategy getters (one answer each: torch_dist), resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.serialization" for name in (
    "get_default_save_sharded_strategy", "get_default_load_sharded_strategy")})

logger = logging.getLogger(__name__)
COMMON_FNAME = "common.pt"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier(group=None) -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    """Host copy detached from later in-place updates (async saves write it while training goes on)."""
    return t.detach().to("cpu", copy=True)


def _split_common(tree):
    """(common, sharded): ``common`` is ``tree`` without sharded leaves (dicts/lists keep their structure,
    sharded leaves become None in lists and are dropped from dicts); ``sharded`` lists ``(path, leaf)``
    for every ShardedTensor/ShardedObject."""
    sharded = [(p, v) for p, v in dict_utils.iter_leaves(tree) if is_sharded(v)]
    return _strip_sharded(tree), sharded


def _strip_sharded(tree):
    if isinstance(tree, dict):
        # A dict that held only sharded leaves is dropped, not kept empty (as Megatron does: its loader merges
        # the loaded tensors into the common state and refuses an empty dict where a tensor goes).
        stripped = {k: _strip_sharded(v) for k, v in tree.items() if not is_sharded(v)}
        return {k: v for k, v in stripped.items() if not (isinstance(v, dict) and not v and tree[k])}
    if isinstance(tree, list):
        return [None if is_sharded(v) else _strip_sharded(v) for v in tree]
    return tree


def _prepare(sharded_state_dict: ShardedStateDict, copy_to_cpu: bool, host_staging=None):
    common, sharded = _split_common(sharded_state_dict)
    tensors = _main_replicas(sharded)
    objects = [v for _, v in sharded if isinstance(v, ShardedObject) and v.is_main_replica()]
    for sh in tensors:
        if sh.data is None:
            raise CheckpointingException(f"ShardedTensor {sh.key} has no data to save")
    if host_staging is not None:
        data = host_staging.stage([sh.data for sh in tensors])
    else:
        data = [_to_cpu(sh.data) if copy_to_cpu else sh.data.detach() for sh in tensors]
    shards = torch_strategy.tensor_shards(tensors, data)
    return common, shards, torch_strategy.object_shards(objects)


def _main_replicas(sharded):
    """The ShardedTensors among ``sharded`` ([(path, leaf)]) this rank writes."""
    return [v for _, v in sharded if isinstance(v, ShardedTensor) and v.is_main_replica()]


def _split_nonpersistent(sharded_state_dict: ShardedStateDict):
    """(the state dict with None for each LocalNonpersistentObject, [(path, object)] of those)."""
    local = [(p, v) for p, v in dict_utils.iter_leaves(sharded_state_dict) if isinstance(v, LocalNonpersistentObject)]
    if not local:
        return sharded_state_dict, local
    return dict_utils.map_leaves(lambda v: None if isinstance(v, LocalNonpersistentObject) else v,
                                 sharded_state_dict), local


def _check_sharding(sharded_state_dict, process_group) -> None:
    """Every chunk of every tensor written by exactly one rank: the group's first rank checks, every rank
    raises the same CheckpointingException (none is left waiting in a collective)."""
    _, global_metadata = determine_global_metadata(sharded_state_dict, process_group)
    verdict = [sharding_error(global_metadata) if _rank_in(process_group) == 0 else None]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(process_group) > 1:
        src = torch.distributed.get_global_rank(process_group, 0) if process_group is not None else 0
        torch.distributed.broadcast_object_list(verdict, src=src, group=process_group)
    if verdict[0] is not None:
        raise CheckpointingException(verdict[0])


def _rank_in(group) -> int:
    return torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0


def _write_common(checkpoint_dir: str, common: Dict[str, Any]) -> None:
    if _rank() != 0:
        return
    path = os.path.join(checkpoint_dir, COMMON_FNAME)
    torch.save(common, path + ".tmp")
    os.replace(path + ".tmp", path)


def save(sharded_state_dict: ShardedStateDict, checkpoint_dir: str, sharded_strategy=None,
         validate_access_integrity: bool = True, async_sharded_save: bool = False,
         preprocess_common_before_consistancy_check=None, content_metadata: Optional[dict] = None,
         async_strategy: str = "nvrx", verify_integrity: bool = False, *, common_strategy=None,
         process_group=None, host_staging: Optional[HostStaging] = None,
         defer_host_copy: bool = False) -> Optional[AsyncRequest]:
    """Save ``sharded_state_dict`` into ``checkpoint_dir`` (collective over all ranks).

    `validate_access_integrity` checks, before writing, that the main replicas of all ranks cover every
    tensor's chunk grid exactly once (a CheckpointingException otherwise); `content_metadata` is stored
    with the common state (read back by load_content_metadata);
    A `FullyParallelSaveStrategyWrapper` as ``sharded_strategy`` spreads the writes of tensors replicated
    over its group (the DP replicas of the weights) evenly over that group's ranks (fully_parallel.py).
    `async_strategy` names Megatron's async backends and has no effect (async saves run through
    AsyncRequest/AsyncCallsQueue); `verify_integrity` writes integrity.json (SHA-256 per file) for
    load(verify_integrity=True); the common-state consistency check is refused.

    Only main replicas (``replica_id == 0``) are written. With ``async_sharded_save`` tensors are copied to
    host memory now and an `AsyncRequest` is returned whose function writes them (run it with an
    `AsyncCallsQueue`); `metadata.json` is written by its finalize step. With ``host_staging`` (our
    extension; async saves only) the copy goes into its reusable buffers and CUDA tensors are only queued
    for copying: call ``host_staging.make_current_stream_wait()`` before changing any saved tensor in place.
    ``defer_host_copy`` (our extension, async saves without ``host_staging``): the request keeps the tensors
    where they are and its function copies them to the host while it writes (DCP's copy-ahead, overlapping the
    device-to-host copies with the file writes); for a request run before anything changes the state (a
    synchronous save that wants the request's finalize steps), where copying 56 GB per GPU to pageable memory
    first, as an async save must, took ~35 s of a 119-131 s Llama-3-8B save.
    """
    if sharded_strategy not in (None, "torch_dist") and not isinstance(sharded_strategy, (
            tuple, torch_strategy.TorchDistSaveShardedStrategy, FullyParallelSaveStrategyWrapper)):
        raise ValueError(f"sharded_strategy {sharded_strategy!r} is not supported; use None, 'torch_dist', "
                         "a TorchDistSaveShardedStrategy or a FullyParallelSaveStrategyWrapper")
    thread_count = getattr(sharded_strategy, "thread_count", 1)
    if preprocess_common_before_consistancy_check is not None:
        raise NotImplementedError("dist_checkpointing.save: the common-state consistency check "
                                  "(preprocess_common_before_consistancy_check) is not supported; leave it None")
    sharded_state_dict = _to_write(sharded_state_dict, sharded_strategy, process_group, validate_access_integrity)
    if content_metadata is not None:
        sharded_state_dict = {**sharded_state_dict, _CONTENT_METADATA_KEY: content_metadata}
    if _rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        if os.path.exists(os.path.join(checkpoint_dir, CONFIG_FNAME)):
            raise CheckpointingException(f"{checkpoint_dir} already holds a checkpoint; save into an empty directory")
    if host_staging is not None and not async_sharded_save:
        raise ValueError("dist_checkpointing.save: host_staging is for async saves; pass async_sharded_save=True")
    if defer_host_copy and (host_staging is not None or not async_sharded_save):
        raise ValueError("dist_checkpointing.save: defer_host_copy is for an async request without host_staging")
    _barrier(process_group)
    common, shards, objects = _prepare(sharded_state_dict, async_sharded_save and not defer_host_copy,
                                       host_staging)
    try:
        _write_common(checkpoint_dir, common)
    except BaseException:
        if host_staging is not None:
            host_staging.release()
        raise

    def write(group=process_group):
        if host_staging is None:
            torch_strategy.dcp_write(checkpoint_dir, shards, objects, process_group=group, thread_count=thread_count)
            return
        try:
            host_staging.wait_copy()
            torch_strategy.dcp_write(checkpoint_dir, shards, objects, process_group=group, thread_count=thread_count)
        finally:
            host_staging.release()

    def finalize():
        if _rank() == 0:
            save_config(None, checkpoint_dir)
            if verify_integrity:
                save_integrity_manifest(checkpoint_dir)

    if async_sharded_save:
        return AsyncRequest(write, finalize_fns=[finalize], description=checkpoint_dir)
    write()
    finalize()
    _barrier(process_group)
    return None


def staged_bytes(sharded_state_dict: ShardedStateDict, sharded_strategy=None, process_group=None) -> int:
    """Host bytes an async `save` of ``sharded_state_dict`` with the same ``sharded_strategy`` stages on this
    rank (its main replicas; with a `FullyParallelSaveStrategyWrapper` its share of the replicated tensors), to
    reserve the buffers ahead of the first save (`HostStaging.reserve`). Collective as `save` is (the same call
    on every rank); it reads no tensor data and changes the state dict as `save` does (factories applied)."""
    sharded_state_dict = _to_write(sharded_state_dict, sharded_strategy, process_group, validate=False)
    return HostStaging.bytes_for([sh.data for sh in _main_replicas(_split_common(sharded_state_dict)[1])
                                  if sh.data is not None])


def _to_write(sharded_state_dict, sharded_strategy, process_group, validate: bool):
    """The state dict as `save` writes it: factories applied (in place, as Megatron), non-persistent entries
    dropped, the sharding checked (``validate``) and, with a fully parallel strategy, the replicated tensors'
    writes spread over its group."""
    apply_factories(sharded_state_dict)
    sharded_state_dict, _ = _split_nonpersistent(sharded_state_dict)
    if validate:
        _check_sharding(sharded_state_dict, process_group)
    if isinstance(sharded_strategy, FullyParallelSaveStrategyWrapper):
        distribute_main_replicas(sharded_state_dict, sharded_strategy.parallelization_group)
    return sharded_state_dict


def save_in_megatron_layout(sharded_state_dict: ShardedStateDict, checkpoint_dir: str, num_layers: int,
                            num_experts: Optional[int] = None, **kwargs) -> Optional[AsyncRequest]:
    """`save` in Megatron Core's torch_dist layout, which Megatron-LM's ``dist_checkpointing.load`` reads:
    transformer layers stacked (`megatron_layout.to_megatron_layout`, ``num_layers`` = the model's total), an
    ``_extra_state`` object per linear layer, and every ShardedObject stored as Megatron encodes it, ``[data]``.
    ``num_experts``: the MoE expert count (sequential experts). ``kwargs`` go to `save`."""
    stacked = megatron_layout.to_megatron_layout(sharded_state_dict, num_layers, num_experts)
    encoded = dict_utils.map_leaves(
        lambda v: replace(v, data=[v.data]) if isinstance(v, ShardedObject) else v, stacked)
    return save(encoded, checkpoint_dir, **kwargs)


def load_common_state_dict(checkpoint_dir: str) -> Dict[str, Any]:
    """The non-sharded part of a checkpoint (args, iteration, scheduler state...), read on any rank."""
    if maybe_load_config(checkpoint_dir) is None:
        raise CheckpointingException(
            f"{checkpoint_dir} is not a complete torch_dist checkpoint (no {CONFIG_FNAME})")
    path = os.path.join(checkpoint_dir, COMMON_FNAME)
    if os.path.isfile(path):
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointingException(f"corrupted checkpoint file {path}: {type(e).__name__}: {e}") from e
    # Newer Megatron checkpoints keep the common state as a DCP object: 'common_state', or since Megatron Core
    # 0.19 the ShardedObject 'common_state/shard_0_1'.
    keys = [k for k in _read_dcp_metadata(checkpoint_dir).state_dict_metadata
            if k == "common_state" or k.startswith("common_state/shard_")]
    if not keys:
        raise CheckpointingException(f"{checkpoint_dir} has neither {COMMON_FNAME} nor a 'common_state' object")
    return _unwrap_object(keys[0], _guarded_read(checkpoint_dir, {}, keys[:1], no_dist=True)[keys[0]])


def fp8_extra_state_key(checkpoint_dir: str) -> Optional[str]:
    """The first ``_extra_state`` object of a checkpoint that carries Transformer Engine FP8 scaling state (scales,
    amax history of an --fp8 run), or None (read on any rank; the objects are small)."""
    keys = sorted(k for k, v in _read_dcp_metadata(checkpoint_dir).state_dict_metadata.items()
                  if not hasattr(v, "size") and "._extra_state" in k)
    if not keys:
        return None
    objs = _guarded_read(checkpoint_dir, {}, keys, no_dist=True)
    for key in keys:
        value = objs[key]
        if isinstance(value, list) and len(value) == 1:  # Megatron's encoding of a ShardedObject
            value = value[0]
        if has_fp8_scaling_state(value):
            return key
    return None


def _unwrap_object(key: str, saved):
    """A ShardedObject as Megatron Core writes it: a list of its copies (one per main replica), ``[data]``."""
    if not (isinstance(saved, list) and len(saved) == 1):
        raise CheckpointingException(f"checkpoint object '{key}' is a {type(saved).__name__}, not the one-item list "
                                     "that Megatron Core's torch_dist encoding stores; re-save it with Megatron-LM")
    return saved[0]


def load_tensors_metadata(checkpoint_dir: str, sharded_strategy=None) -> Dict[str, ShardedTensor]:
    """``{key: ShardedTensor without data}`` for every tensor of the checkpoint (unsharded: global_shape
    and dtype are what they tell), without reading tensor data."""
    verify_checkpoint(checkpoint_dir)
    return {key: ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype, device="meta")).without_data()
            for key, (shape, dtype) in tensor_shapes(checkpoint_dir).items()}


def load_sharded_metadata(checkpoint_dir: str, sharded_strategy=None) -> Dict[str, Any]:
    """load_tensors_metadata plus a data-less ShardedObject per saved object shard (keyed by its
    unique_key)."""
    verify_checkpoint(checkpoint_dir)
    md = _read_dcp_metadata(checkpoint_dir)
    out = {}
    for key, v in md.state_dict_metadata.items():
        if not hasattr(v, "size") and "/shard_" in key:
            obj = ShardedObject.empty_from_unique_key(key)
            out[obj.unique_key] = obj
    out.update(load_tensors_metadata(checkpoint_dir, sharded_strategy))
    return out


def tensor_shapes(checkpoint_dir: str) -> Dict[str, Any]:
    """``{key: (global_shape, dtype)}`` for every tensor in the checkpoint, without reading data."""
    md = _read_dcp_metadata(checkpoint_dir)
    out = {}
    for k, v in md.state_dict_metadata.items():
        if hasattr(v, "size"):
            out[k] = (tuple(v.size), v.properties.dtype)
    return out


def _read_dcp_metadata(checkpoint_dir: str):
    try:
        return torch_strategy.read_metadata(checkpoint_dir)
    except Exception as e:
        raise CheckpointingException(
            f"corrupted or missing checkpoint file {os.path.join(checkpoint_dir, '.metadata')}: "
            f"{type(e).__name__}: {e}") from e


def _truncated_files(checkpoint_dir: str):
    """Files shorter than the byte ranges DCP's metadata records for them."""
    try:
        md = torch_strategy.read_metadata(checkpoint_dir)
    except Exception:
        return []
    need = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    bad = []
    for rel, n in sorted(need.items()):
        p = os.path.join(checkpoint_dir, rel)
        if not os.path.isfile(p) or os.path.getsize(p) < n:
            bad.append(p)
    return bad


def _guarded_read(checkpoint_dir, shards, object_keys, **kwargs):
    _read_dcp_metadata(checkpoint_dir)
    try:
        return torch_strategy.dcp_read(checkpoint_dir, shards, object_keys, **kwargs)
    except CheckpointingException:
        raise
    except (Exception, DCPException) as e:  # DCP's exception derives from BaseException
        inner = getattr(e, "failures", None)
        if isinstance(inner, dict):
            for failure in inner.values():
                if isinstance(failure, CheckpointingException):
                    raise failure from e
                if isinstance(failure, tuple) and failure and isinstance(failure[0], CheckpointingException):
                    raise failure[0] from e
        bad = _truncated_files(checkpoint_dir)
        where = f"truncated or missing file(s) {', '.join(bad)}" if bad else _first_failure(e)
        raise CheckpointingException(f"failed to read checkpoint {checkpoint_dir}: {where}") from e


def _first_failure(e) -> str:
    """'rank R: <error>' for the first rank DCP reports failing, else the exception's type."""
    for rank, failure in sorted((getattr(e, "failures", None) or {}).items()):
        exc = failure[0] if isinstance(failure, tuple) and failure else failure
        return f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0]
    return type(e).__name__


def load(sharded_state_dict: ShardedStateDict, checkpoint_dir: str, sharded_strategy=None,
         validate_access_integrity: bool = True, strict=StrictHandling.ASSUME_OK_UNEXPECTED,
         verify_integrity: bool = False, process_group=None, *, common_strategy=None):
    """Load the tensors and objects described by ``sharded_state_dict`` (collective over all ranks).

    Returns the checkpoint's common state merged with the loaded values, in the structure of
    ``sharded_state_dict`` (ready for ``model.load_state_dict``); for the ``return_unexpected`` and
    ``return_all`` strict modes a tuple (state dict, missing keys, unexpected keys), as Megatron. Each
    rank reads the slices its ShardedTensors ask for, so the saving layout may differ from the loading
    one. A ShardedTensor with ``allow_shape_mismatch`` reads what the saved tensor covers and is zero
    elsewhere. With a `FullyParallelLoadStrategyWrapper` as ``sharded_strategy`` a chunk that several ranks
    of its group request is read once and broadcast (same values, fewer reads). A rank whose request fails
    makes every rank raise the same one-line error (none hangs).
    """
    if verify_integrity:
        verify_integrity_manifest(checkpoint_dir)
    if sharded_strategy not in (None, "torch_dist") and not isinstance(sharded_strategy, (
            tuple, torch_strategy.TorchDistLoadShardedStrategy, FullyParallelLoadStrategyWrapper)):
        raise ValueError(f"sharded_strategy {sharded_strategy!r} is not supported; use None, 'torch_dist', "
                         "a TorchDistLoadShardedStrategy or a FullyParallelLoadStrategyWrapper")
    strict = parse_strict_flag(strict)
    # The saved tensors' shapes, read once (an incomplete checkpoint has none; the load below says so in one line).
    # A failure here is raised inside the try below, so that every rank learns of it.
    try:
        complete = maybe_load_config(checkpoint_dir) is not None
        saved, unreadable = (tensor_shapes(checkpoint_dir) if complete else {}), None
    except Exception as e:
        saved, unreadable = {}, e
    megatron_encoded = megatron_layout.is_megatron_layout(saved)
    if megatron_encoded:  # a checkpoint in Megatron-LM's own layout: ask for its stacked keys
        sharded_state_dict = _match_megatron_layout(sharded_state_dict, saved)
    factories, _ = dict_utils.extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True)
    apply_factories(sharded_state_dict)
    sharded_state_dict, local = _split_nonpersistent(sharded_state_dict)
    try:
        if unreadable is not None:
            raise unreadable
        _use_saved_spec_names(sharded_state_dict, saved)
        sharded_state_dict, ckpt_keys, unexpected = _check_request(sharded_state_dict, checkpoint_dir, strict)
        common = load_common_state_dict(checkpoint_dir)
        _, sharded = _split_common(sharded_state_dict)
        tensors = [(p, sh) for p, sh in sharded if isinstance(sh, ShardedTensor)]
        objects = [(p, sh) for p, sh in sharded if not isinstance(sh, ShardedTensor)]
        bufs = [_buffer_for(sh, saved.get(sh.key)) for _, sh in tensors]
        shards = torch_strategy.tensor_shards([sh for _, sh in tensors], bufs)
        error = None
    except Exception as e:  # every rank learns of it below, then raises
        error, failure = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointingException) else str(e), e
    want_keys = StrictHandling.requires_global_app_metadata(strict)
    gathered = _gather_from_ranks((error, {sh.key for _, sh in _split_common(sharded_state_dict)[1]}
                                   if want_keys and error is None else None), process_group)
    if error is not None and len(gathered) == 1:
        raise failure
    for rank, (err, _) in enumerate(gathered):
        if err is not None:
            raise CheckpointingException(f"load of {checkpoint_dir} failed on rank {rank}: {err}")
    missing = set()
    if want_keys:
        missing, _ = determine_missing_and_unexpected_keys(ckpt_keys, set(), set().union(*(k for _, k in gathered)))
    _handle_mismatch(strict, missing, unexpected)
    allow = [sh.key for _, sh in tensors if sh.allow_shape_mismatch]
    exchange = []
    if isinstance(sharded_strategy, FullyParallelLoadStrategyWrapper):  # read replicated chunks once each
        group = sharded_strategy.parallelization_group
        mine, exchange = plan_parallel_reads([sh for _, sh in tensors], group)
        shards = torch_strategy.tensor_shards([tensors[i][1] for i in mine], [bufs[i] for i in mine])
    objs = _guarded_read(checkpoint_dir, shards, sorted({o.unique_key for _, o in objects}),
                         process_group=process_group, allow_shape_mismatch=allow)
    if exchange:
        device = bufs[0].device if bufs else None
        exchange_loaded(exchange, {shard_id(sh): buf for (_, sh), buf in zip(tensors, bufs)}, group, device)
    if megatron_encoded:
        objs = {k: _unwrap_object(k, v) for k, v in objs.items()}
    merged = common if isinstance(common, dict) else {}
    dict_utils.prune_shells(merged, sharded_state_dict)
    for (path, _), buf in zip(tensors, bufs):
        dict_utils.set_path(merged, path, buf)
    for path, o in objects:
        dict_utils.set_path(merged, path, objs[o.unique_key])
    for path, value in local:
        dict_utils.set_path(merged, path, value.unwrap())
    merged = apply_factory_merges(merged, factories) if factories else merged
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return merged, missing, unexpected
    return merged


def _use_saved_spec_names(sharded_state_dict, saved) -> None:
    """In place: a requested tensor the checkpoint (``saved``: its tensor keys) lacks under its own name but
    holds under the other layer spec's name (Transformer Engine vs local, te_key_map.py) is read from there."""
    for path, sh in _split_common(sharded_state_dict)[1]:
        if isinstance(sh, ShardedTensor) and sh.key not in saved and alternative_key(sh.key) in saved:
            dict_utils.set_path(sharded_state_dict, path, replace(sh, key=alternative_key(sh.key)))


def _check_request(sharded_state_dict, checkpoint_dir, strict: StrictHandling):
    """(the request without the keys the checkpoint lacks, the checkpoint's keys, those unexpected keys)
    for the strict modes that compare keys with the checkpoint (Megatron drops unexpected keys from the
    load); the request unchanged and empty sets under ``assume_ok_unexpected``. Raises here, on this
    rank, for ``raise_*`` modes with unexpected keys."""
    if not StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        return sharded_state_dict, set(), set()
    ckpt_keys = {v.key for v in load_sharded_metadata(checkpoint_dir).values()} - {"common_state"}
    local_keys = {sh.key for _, sh in _split_common(sharded_state_dict)[1]}
    _, unexpected = determine_missing_and_unexpected_keys(ckpt_keys, local_keys)
    if unexpected and strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        raise CheckpointingException(f"checkpoint {checkpoint_dir}: {mismatch_message(set(), unexpected)}")
    return adjust_non_strict_load(sharded_state_dict, unexpected), ckpt_keys, unexpected


def _handle_mismatch(strict: StrictHandling, missing, unexpected) -> None:
    """Raise (the same on every rank: missing keys are global) or log per ``strict``."""
    if strict == StrictHandling.RAISE_ALL:
        maybe_report_missing_and_unexpected_keys(missing, set(), True)
    elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        maybe_report_missing_and_unexpected_keys(missing, unexpected, False)


def _gather_from_ranks(value, process_group):
    """``value`` of every rank of ``process_group`` (``[value]`` outside a multi-rank run)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(process_group) == 1:
        return [value]
    gathered = [None] * torch.distributed.get_world_size(process_group)
    torch.distributed.all_gather_object(gathered, value, group=process_group)
    return gathered


def _match_megatron_layout(sharded_state_dict: ShardedStateDict, shapes) -> ShardedStateDict:
    """The request in the stacked-layer layout of a checkpoint Megatron-LM wrote (``shapes``: its tensors'
    shapes), or unchanged when it already asks for stacked keys."""
    requested = [v.key for _, v in dict_utils.iter_leaves(sharded_state_dict) if isinstance(v, ShardedTensor)]
    if megatron_layout.is_megatron_layout(requested):
        return sharded_state_dict
    num_layers, num_experts = megatron_layout.stacked_sizes(shapes)
    return megatron_layout.to_megatron_layout(sharded_state_dict, num_layers, num_experts, extra_state=False)


def _buffer_for(sh: ShardedTensor, saved=None) -> torch.Tensor:
    """Where the chunk is read into: the ShardedTensor's own tensor when it has the chunk's shape and dtype
    (the live param or optimizer state is read in place: a second copy of an 8B model's optimizer state
    does not fit beside it on the device; a load that fails part-way ends the run or is followed by a whole
    load of the previous checkpoint); else zeros under ``allow_shape_mismatch`` (the part past the saved
    shape is not read and stays zero, as in Megatron), uninitialised otherwise (every element is read).
    ``saved``: the checkpoint's (global shape, dtype) of the key; a tensor that allows a shape mismatch but
    whose saved shape is its own (a padded vocabulary saved at the same padding) is read in place as well."""
    data = sh.data
    covered = not sh.allow_shape_mismatch or (saved is not None and tuple(saved[0]) == tuple(sh.global_shape))
    if (type(data) in (torch.Tensor, torch.nn.Parameter) and covered  # no DTensor, FP8 subclass
            and tuple(data.shape) == tuple(sh.local_shape)
            and data.dtype == sh.dtype and data.is_contiguous()):
        return data.detach()
    device = data.device if data is not None else "cpu"
    init = torch.zeros if sh.allow_shape_mismatch else torch.empty
    return init(sh.local_shape, dtype=sh.dtype, device=device)


_CONTENT_METADATA_KEY = "content_metadata"


def load_content_metadata(checkpoint_dir: Optional[str] = None, preloaded_state_dict: Optional[dict] = None):
    """The `content_metadata` dict given to save (None when the checkpoint has none)."""
    common = preloaded_state_dict if preloaded_state_dict is not None else load_common_state_dict(checkpoint_dir)
    return common.get(_CONTENT_METADATA_KEY) if isinstance(common, dict) else None


def load_plain_tensors(checkpoint_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole (unsharded), keyed by its global key (collective)."""
    request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype))
               for key, (shape, dtype) in tensor_shapes(checkpoint_dir).items()}
    loaded = load(request, checkpoint_dir, validate_access_integrity=False)
    return {key: loaded[key] for key in request}


def remove_sharded_tensors(checkpoint_dir: str, key_prefix: str):
    """Drop the tensors and objects whose keys start with ``key_prefix`` from a saved checkpoint
    (e.g. optimizer state before sharing weights). Run it on one process."""
    verify_checkpoint(checkpoint_dir)
    torch_strategy.TorchDistLoadShardedStrategy().remove_sharded_tensors(checkpoint_dir, key_prefix)
