"""Process-wide switch for Megatron Core's experimental APIs (`--enable-experimental`)."""

ENABLE_EXPERIMENTAL = False


def set_experimental_flag(flag: bool):
    """Turn experimental APIs on or off for this process."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = flag


def is_experimental_enabled():
    """Whether experimental APIs are enabled."""
    return ENABLE_EXPERIMENTAL
