"""Application-level checkpointing (Megatron's `megatron.training.checkpointing`).

`save_checkpoint` / `load_checkpoint` orchestrate `megatron.core.dist_checkpointing` (torch_dist) or
per-rank pickles (legacy torch), the tracker file, atomic publication and async saves.
"""
from .load import check_checkpoint_args, load_checkpoint
from .paths import detect_format, get_checkpoint_name, get_checkpoint_tracker_filename, read_metadata
from .save import reserve_async_save_buffers, save_checkpoint
from .state import get_rng_state, set_rng_state

__all__ = ["save_checkpoint", "load_checkpoint", "get_checkpoint_name", "get_checkpoint_tracker_filename",
           "read_metadata", "detect_format", "get_rng_state", "set_rng_state", "check_checkpoint_args",
           "reserve_async_save_buffers"]
