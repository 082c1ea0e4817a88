"""Descriptions of state that is saved under a global, layout-independent key.

A `ShardedTensor` says "this local tensor is the slice at `global_offset` of the global tensor `key`
of shape `global_shape`". Saving and loading work on these descriptions, so a checkpoint written under
one parallel layout can be read under another.
"""
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

import torch

from .dict_utils import dict_list_map_inplace


def is_main_replica(replica_id) -> bool:
    """Replica id 0 (or all zeros): the copy that is written."""
    return all(r == 0 for r in replica_id) if isinstance(replica_id, (tuple, list)) else replica_id == 0


class LocalNonpersistentObject:
    """A rank-local value kept out of checkpoints: ``save`` drops it and ``load`` puts ``obj`` back
    unchanged (state that must not be restored, e.g. a rank's own iterator position)."""

    def __init__(self, obj):
        self.obj = obj

    def unwrap(self):
        return self.obj


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

    @property
    def has_regular_grid(self) -> bool:
        """The global tensor is an even grid of chunks (axis_fragmentations known)."""
        return self.axis_fragmentations is not None

    def global_slice(self):
        """Index of this shard in the global tensor (ints on the prepended axes, slices elsewhere)."""
        n = self.prepend_axis_num
        return tuple(self.global_offset[:n]) + tuple(
            slice(o, o + s) for o, s in zip(self.global_offset[n:], self.local_shape))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Position of this shard in the grid of chunks."""
        n = self.prepend_axis_num
        return tuple(self.global_offset[:n]) + tuple(
            o // s for o, s in zip(self.global_offset[n:], self.local_shape))

    def without_data(self):
        return replace(self, data=None)

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

    def without_data(self):
        return replace(self, data=None)

    @classmethod
    def empty_from_unique_key(cls, unique_key, replica_id=0) -> "ShardedObject":
        """The data-less ShardedObject whose unique_key this is ('key/shard_<offset>_<shape>')."""
        key, shard = unique_key.rsplit("/shard_", 1)
        offset, shape = shard.split("_")
        as_ints = lambda text: tuple(int(x) for x in text.split("."))  # noqa: E731
        return cls(key, None, as_ints(shape), as_ints(offset), replica_id)



ShardedStateDict = dict


def is_sharded(x) -> bool:
    """A ShardedTensor or ShardedObject: a leaf saved under a global key rather than in the common state."""
    return isinstance(x, (ShardedTensor, ShardedObject))


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved in another form: `build_fn(key, data, replica_id, flattened_range)` turns it into a
    sharded state dict before saving (e.g. one ShardedTensor per half of a fused weight), and
    `merge_fn(loaded_sub_state_dict)` turns what was loaded back into one tensor. Optimizer state built
    from a param's factory gets the same transformation."""
    key: str
    data: torch.Tensor
    build_fn: Callable
    merge_fn: Callable
    replica_id: Any = 0
    flattened_range: Optional[slice] = None

    def build(self):
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self):
        """Nothing to check before building."""

    def without_data(self):
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict):
    """Replace every ShardedTensorFactory of the (nested) state dict by what it builds, in place."""
    dict_list_map_inplace(lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x, sharded_state_dict)


def apply_factory_merges(x1, x2, key: Tuple = ()):
    """Merge the loaded state dict `x1` back through the factories found in `x2` (the subset of x1's
    keys that held factories, lists given as {index: value}); x1 is changed in place and returned."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x2, dict) and isinstance(x1, (dict, list)):
        for k, v2 in x2.items():
            if isinstance(x1, dict) and k not in x1:
                raise ValueError(f"apply_factory_merges: key {key + (k,)} is missing from the loaded state dict")
            if isinstance(x1, list) and not (isinstance(k, int) and 0 <= k < len(x1)):
                raise ValueError(f"apply_factory_merges: index {k} at {key} is outside the loaded list")
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"apply_factory_merges: lists of lengths {len(x1)} and {len(x2)} at {key}")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
        return x1
    raise ValueError(f"apply_factory_merges: two values at {key}: {x1!r} and {x2!r}")
