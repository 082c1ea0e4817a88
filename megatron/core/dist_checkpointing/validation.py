"""How `dist_checkpointing.load` treats keys that the checkpoint and the request do not share."""
from enum import Enum
from typing import Union


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
