"""Megatron Core's load-time strictness entry point of ``dist_checkpointing.validation`` that this project's
``load`` does not call (it checks keys against the checkpoint's metadata itself). Reached from
``megatron.core.dist_checkpointing.validation`` through its lazy alias table.
"""
import logging

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    _nested_sharded,
    adjust_non_strict_load,
    determine_missing_and_unexpected_keys,
    maybe_report_missing_and_unexpected_keys,
    parse_strict_flag,
    validate_sharding_integrity,
)

logger = logging.getLogger(__name__)


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
        missing, unexpected = determine_missing_and_unexpected_keys(
            {sh.key for sh in ckpt_sharded_metadata.values()}, {sh.key for sh in local_metadata},
            None if skip_missing else {sh.key for rank in global_metadata or () for sh in rank})
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
