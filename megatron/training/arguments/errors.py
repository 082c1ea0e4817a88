"""ArgumentError, the exception every bad flag raises.

It lives below every flag group, the validation and the checkpoint-args reader, so that each of them can
raise it without importing the others.
"""
from megatron.core.errors import InputError


class ArgumentError(InputError):
    """A user configuration error; the entry point prints `[rank R] ArgumentError: <message>`, exits 2."""


def require(cond, message: str) -> None:
    """Raise ArgumentError(message) unless ``cond`` holds."""
    if not cond:
        raise ArgumentError(message)
