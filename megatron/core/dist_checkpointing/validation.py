"""Checks around `dist_checkpointing.save/load`: how load treats keys that the checkpoint and the request
do not share (StrictHandling), whether a sharding pattern covers every tensor exactly once, and an
integrity manifest (SHA-256 per file)."""
import hashlib
import json
import logging
import math
import os
from enum import Enum
from typing import List, Optional, Set, Tuple, Union

import numpy as np
import torch

from megatron.core.utils import lazy_names

from .core import CheckpointingException, check_is_distributed_checkpoint
from .dict_utils import extract_matching_values, iter_leaves
from .mapping import ShardedObject, is_sharded

# Megatron's strict-load entry point that this package's load does not call, resolved on first use.
__getattr__ = lazy_names(__name__, {"validate_integrity_and_strict_load": "megatron.core._compat.validation"})

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """`load(strict=...)` values. *_UNEXPECTED variants trust that requested keys exist (no extra
    metadata read); *_ALL variants check requested keys against the checkpoint's metadata."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL,
                       StrictHandling.LOG_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """A StrictHandling from its value string (or itself); one-line ValueError for anything else."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError:
        choices = ", ".join(s.value for s in StrictHandling)
        raise ValueError(f"dist_checkpointing strict flag '{strict}' unknown; use one of {choices}") from None


# ---- keys that the request and the checkpoint do not share ----------------------------------------------

def determine_missing_and_unexpected_keys(ckpt_keys: Set[str], local_keys: Set[str],
                                          global_keys: Optional[Set[str]] = None) -> Tuple[Set[str], Set[str]]:
    """(missing, unexpected): checkpoint keys that no rank requests (empty without `global_keys`, the
    keys of every rank), and keys this rank requests that the checkpoint lacks (may differ per rank)."""
    missing = set() if global_keys is None else set(ckpt_keys) - set(global_keys)
    return missing, set(local_keys) - set(ckpt_keys)


def adjust_non_strict_load(sharded_state_dict, sharded_keys_to_remove: Set[str]):
    """The state dict without the ShardedTensors/Objects whose key is in `sharded_keys_to_remove`."""
    _, kept = extract_matching_values(sharded_state_dict,
                                      lambda x: is_sharded(x) and x.key in sharded_keys_to_remove)
    return kept


def mismatch_message(missing_keys: Set[str], unexpected_keys: Set[str]) -> Optional[str]:
    """One line naming the keys that the checkpoint and the request do not share (None when none)."""
    msg = []
    if missing_keys:
        msg.append(f"keys in the checkpoint that no rank requested (missing): {sorted(missing_keys)}")
    if unexpected_keys:
        msg.append(f"requested keys that the checkpoint lacks (unexpected, this rank): {sorted(unexpected_keys)}")
    return "; ".join(msg) or None


def maybe_report_missing_and_unexpected_keys(missing_keys: Set[str], unexpected_keys: Set[str],
                                             raise_error: bool = True) -> None:
    """Raise (or log with `raise_error` False) when the request and the checkpoint differ in keys."""
    msg = mismatch_message(missing_keys, unexpected_keys)
    if msg is None:
        return
    if raise_error:
        raise CheckpointingException(msg)
    logger.warning(msg)


# ---- checks of a load request and of a sharding pattern ---------------------------------------------

def _nested_sharded(sharded_state_dict):
    return [v for _, v in iter_leaves(sharded_state_dict) if is_sharded(v)]


def verify_checkpoint(checkpoint_dir: str):
    """One-line CheckpointingException unless `checkpoint_dir` holds a complete distributed checkpoint."""
    if not os.path.isdir(str(checkpoint_dir)):
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} does not exist")
    if not check_is_distributed_checkpoint(checkpoint_dir):
        raise CheckpointingException(f"{checkpoint_dir} is not a distributed checkpoint")


def determine_global_metadata(sharded_state_dict, process_group=None):
    """(this rank's ShardedTensors/Objects without data, the list of every rank's), via all_gather_object
    over `process_group` (default: all ranks)."""
    local = [sh.without_data() for sh in _nested_sharded(sharded_state_dict)]
    if not torch.distributed.is_initialized():
        return local, [local]
    gathered = [None] * torch.distributed.get_world_size(group=process_group)
    torch.distributed.all_gather_object(gathered, local, group=process_group)
    return local, gathered


def _sharding_errors(key, shards) -> List[str]:
    first = shards[0]
    for sh in shards:
        if sh.dtype != first.dtype or tuple(sh.global_shape) != tuple(first.global_shape):
            return [f"{key}: ranks disagree on dtype or global shape ({sh.dtype} {sh.global_shape} vs "
                    f"{first.dtype} {first.global_shape})"]
    if not all(sh.has_regular_grid for sh in shards):
        # Uneven chunks (a distributed optimizer's flat ranges): the main replicas must add up to the tensor.
        written = sum(math.prod(sh.local_shape) for sh in shards if sh.is_main_replica())
        if written != math.prod(first.global_shape):
            return [f"{key}: main replicas hold {written} of the {math.prod(first.global_shape)} elements"]
        return []
    counts = torch.zeros(first.axis_fragmentations, dtype=torch.int)
    for sh in shards:
        if sh.is_main_replica():
            counts[sh.local_chunk_offset_in_global()] += 1
    if not torch.all(counts == 1):
        return [f"{key}: each chunk must be written by exactly one main replica; counts {counts.tolist()}"]
    return []


def _object_errors(key, objects) -> List[str]:
    keys = [o.unique_key for o in objects if o.is_main_replica()]
    errors = []
    if len(keys) != len(set(keys)):
        errors.append(f"{key}: duplicate ShardedObject shards {sorted({k for k in keys if keys.count(k) > 1})}")
    expected = int(np.prod(objects[0].global_shape))
    if len(set(keys)) != expected:
        errors.append(f"{key}: {expected - len(set(keys))} of {expected} ShardedObject shards are missing")
    return errors


def validate_sharding_integrity(global_metadata, common_state_dict=None) -> None:
    """On global rank 0: every tensor's main replicas cover its chunk grid exactly once, ranks agree on
    dtype and shape, and every ShardedObject shard is written once. CheckpointingException otherwise.
    `common_state_dict` (the state rank 0 writes unsharded) is accepted and not compared across ranks."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    error = sharding_error(global_metadata)
    if error:
        raise CheckpointingException(error)


def sharding_error(global_metadata) -> Optional[str]:
    """validate_sharding_integrity's verdict as a message (None when the pattern is valid), on any rank."""
    by_key = {}
    for rank_metadata in global_metadata:
        for sh in rank_metadata:
            by_key.setdefault(sh.key, []).append(sh)
    errors = []
    for key, shards in by_key.items():
        errors += _object_errors(key, shards) if isinstance(shards[0], ShardedObject) else _sharding_errors(key, shards)
    return "Invalid sharding pattern: " + "; ".join(errors) if errors else None


# ---- integrity manifest: sha256 of every file, written after a save, checked before a load -------------

INTEGRITY_FNAME = "integrity.json"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_integrity_manifest(checkpoint_dir: str) -> None:
    """Write integrity.json: the SHA-256 of every file of the checkpoint directory."""
    files = {name: _sha256(os.path.join(checkpoint_dir, name)) for name in sorted(os.listdir(checkpoint_dir))
             if name != INTEGRITY_FNAME and os.path.isfile(os.path.join(checkpoint_dir, name))}
    with open(os.path.join(checkpoint_dir, INTEGRITY_FNAME), "w") as f:
        json.dump({"algorithm": "sha256", "files": files}, f, indent=2)


def _integrity_error(checkpoint_dir: str) -> Optional[str]:
    path = os.path.join(checkpoint_dir, INTEGRITY_FNAME)
    if not os.path.exists(path):
        return (f"integrity manifest {path} not found: save the checkpoint with verify_integrity=True to "
                "verify it on load")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("algorithm", "sha256") != "sha256":
        return f"integrity manifest {path}: unsupported hash algorithm {manifest['algorithm']!r}"
    bad = []
    for name, expected in manifest["files"].items():
        full = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(full):
            bad.append(f"{name} (missing)")
        elif _sha256(full) != expected:
            bad.append(f"{name} (hash mismatch)")
    return f"checkpoint integrity check failed in {checkpoint_dir}: {', '.join(bad)}" if bad else None


def verify_integrity_manifest(checkpoint_dir: str) -> None:
    """Re-hash the files listed in integrity.json (rank 0 reads, every rank gets its verdict)."""
    error = [None]
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if not distributed or torch.distributed.get_rank() == 0:
        error = [_integrity_error(checkpoint_dir)]
    if distributed:
        torch.distributed.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointingException(error[0])
