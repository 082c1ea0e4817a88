"""Megatron Core's ``optimizer_param_scheduler.get_canonical_lr_for_logging``, which the log line here does
not call. Reached from ``megatron.core.optimizer_param_scheduler`` through its lazy alias table.
"""
from typing import Optional


def get_canonical_lr_for_logging(param_groups) -> Optional[float]:
    """LR of the first group on the default schedule (`default_config`), what the log line shows; None
    when every group has its own LR override."""
    for group in param_groups:
        if group.get("default_config", False):
            return group.get("lr")
    return None
