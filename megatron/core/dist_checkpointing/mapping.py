"""Descriptions of state that is saved under a global, layout-independent key.

A `ShardedTensor` says "this local tensor is the slice at `global_offset` of the global tensor `key`
of shape `global_shape`". Saving and loading work on these descriptions, so a checkpoint written under
one parallel layout can be read under another.
"""
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import torch


def is_main_replica(replica_id) -> bool:
    """Replica id 0 (or all zeros): the copy that is written."""
    return all(r == 0 for r in replica_id) if isinstance(replica_id, (tuple, list)) else replica_id == 0


class ShardedBase:
    """What ShardedTensor and ShardedObject share: a global `key`, local `data`, a `replica_id`."""

    key: str
    data: Any
    replica_id: Any

    def is_main_replica(self) -> bool:
        return is_main_replica(self.replica_id)


@dataclass
class ShardedTensor(ShardedBase):
    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]] = None
    # Zero (or all zeros) on exactly one rank per distinct shard: that rank writes it.
    replica_id: Any = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self):
        if self.flattened_range is not None:
            raise NotImplementedError(f"ShardedTensor {self.key}: flattened_range (flat optimizer-state "
                                      "shards) is not supported; describe the shard by offsets")

    @classmethod
    def from_rank_offsets(cls, key, data, *rank_offsets, replica_id=0, prepend_axis_num=0, **kwargs):
        """Shard ``data`` along the given axes: each ``(axis, rank, num_ranks)`` says that along ``axis``
        this rank holds fragment ``rank`` of ``num_ranks`` equal fragments. ``prepend_axis_num`` adds leading
        global axes of size given by the fragment counts (used to stack per-layer tensors)."""
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * len(global_shape)
        fragmentations = [1] * len(global_shape)
        seen = set()
        for axis, rank, num_ranks in rank_offsets:
            if axis in seen:
                raise ValueError(f"duplicate axis {axis} in rank offsets of {key}")
            seen.add(axis)
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = local * num_ranks
            global_offset[axis] = local * rank
            fragmentations[axis] = num_ranks
        return cls(key, data, data.dtype, tuple(data.shape), tuple(global_shape), tuple(global_offset),
                   tuple(fragmentations), replica_id, prepend_axis_num, **kwargs)



@dataclass
class ShardedObject(ShardedBase):
    """A picklable object saved under ``key``; ``global_shape``/``global_offset`` index its copies
    (e.g. one RNG state per (PP, TP) rank)."""
    key: str
    data: Any
    global_shape: Tuple[int, ...] = (1,)
    global_offset: Tuple[int, ...] = (0,)
    replica_id: Any = 0

    @property
    def unique_key(self) -> str:
        return f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_{'.'.join(map(str, self.global_shape))}"



ShardedStateDict = dict
