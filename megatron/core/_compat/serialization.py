"""Megatron Core's default-strategy getters of ``dist_checkpointing.serialization``: only 'torch_dist' exists
here, so they have one answer each. Reached from ``megatron.core.dist_checkpointing.serialization``
through its lazy alias table.
"""
from typing import Optional

from megatron.core.dist_checkpointing.strategies import torch as torch_strategy


def get_default_save_sharded_strategy(backend: str = "torch_dist"):
    """The save strategy for `backend`: only 'torch_dist' exists here."""
    if backend != "torch_dist":
        raise ValueError(f"checkpoint backend {backend!r} is not supported; use 'torch_dist'")
    return torch_strategy.TorchDistSaveShardedStrategy(backend)


def get_default_load_sharded_strategy(checkpoint_dir: Optional[str] = None):
    return torch_strategy.TorchDistLoadShardedStrategy()
