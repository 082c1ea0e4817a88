"""Megatron Core's load-time strictness helpers of ``dist_checkpointing.validation`` that this project's
``load`` does not call (it checks keys against the checkpoint's metadata itself). Reached from
``megatron.core.dist_checkpointing.validation`` through its lazy alias table.
"""
import logging
from typing import Set

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
from megatron.core.dist_checkpointing.mapping import is_sharded
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    _nested_sharded,
    parse_strict_flag,
    validate_sharding_integrity,
)

logger = logging.getLogger(__name__)


def adjust_non_strict_load(sharded_state_dict, sharded_keys_to_remove: Set[str]):
    """The state dict without the ShardedTensors/Objects whose key is in `sharded_keys_to_remove`."""
    _, kept = extract_matching_values(sharded_state_dict,
                                      lambda x: is_sharded(x) and x.key in sharded_keys_to_remove)
    return kept


def maybe_report_missing_and_unexpected_keys(missing_keys: Set[str], unexpected_keys: Set[str],
                                             raise_error: bool = True) -> None:
    """Raise (or log with `raise_error` False) when the request and the checkpoint differ in keys."""
    if not missing_keys and not unexpected_keys:
        return
    msg = []
    if missing_keys:
        msg.append(f"keys in the checkpoint that no rank requested (missing): {sorted(missing_keys)}")
    if unexpected_keys:
        msg.append(f"requested keys that the checkpoint lacks (unexpected, this rank): {sorted(unexpected_keys)}")
    if raise_error:
        raise CheckpointingException("; ".join(msg))
    logger.warning("; ".join(msg))


def _missing_and_unexpected(ckpt_sharded_metadata, local_metadata, global_metadata):
    ckpt_keys = {sh.key for sh in ckpt_sharded_metadata.values()}
    unexpected = {sh.key for sh in local_metadata} - ckpt_keys
    missing = set() if global_metadata is None else ckpt_keys - {sh.key for rank in global_metadata for sh in rank}
    return missing, unexpected


def validate_integrity_and_strict_load(sharded_state_dict, strict: StrictHandling, validate_access_integrity: bool,
                                       local_metadata=None, global_metadata=None, ckpt_sharded_metadata=None):
    """(request without the keys the checkpoint lacks, missing keys, unexpected keys), handled per
    `strict` (raise / log / return / ignore); with `validate_access_integrity` the requested sharding
    is checked too (needs `global_metadata`)."""
    strict = parse_strict_flag(strict)
    missing, unexpected = set(), set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException("Cannot verify checkpoint mismatch with ckpt_sharded_metadata=None.")
        if local_metadata is None:
            local_metadata = [sh.without_data() for sh in _nested_sharded(sharded_state_dict)]
        skip_missing = strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.RAISE_UNEXPECTED,
                                  StrictHandling.RETURN_UNEXPECTED)
        missing, unexpected = _missing_and_unexpected(ckpt_sharded_metadata, local_metadata,
                                                      None if skip_missing else global_metadata)
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, False)
    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException("Cannot check sharding integrity without global_metadata (None).")
        validate_sharding_integrity(global_metadata)
    return sharded_state_dict, missing, unexpected
