"""Fully parallel save: a tensor that several ranks of a group hold (DP replicas of the weights) is written
once, by one of them, chosen so that every rank of the group writes about the same number of bytes.

Without it the main replica (``replica_id`` 0, DP rank 0) writes every DP-replicated tensor and the other DP
ranks write only their own shards. The files and the checkpoint's content are the same either way; only who
writes which chunk changes.
"""
from typing import Dict, List, Optional, Tuple

import torch

from .. import dict_utils
from ..mapping import ShardedTensor

ShardId = Tuple[str, Tuple[int, ...], Tuple[int, ...]]  # (key, global offset, local shape)


class FullyParallelSaveStrategyWrapper:
    """Megatron's wrapper for ``dist_checkpointing.save(sharded_strategy=...)``: the torch_dist save of
    ``strategy`` with the writes of replicated tensors spread over ``parallelization_group`` (Megatron passes
    the DP group with context parallel). ``do_cache_distribution`` (Megatron reuses the plan) computes it again
    each save here, same result."""

    def __init__(self, strategy=None, parallelization_group=None, do_cache_distribution: bool = False):
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.thread_count = getattr(strategy, "thread_count", 1)


def _shard_id(sh: ShardedTensor) -> ShardId:
    return sh.key, tuple(sh.global_offset), tuple(sh.local_shape)


def _nbytes(sh: ShardedTensor) -> int:
    return sh.data.numel() * sh.data.element_size() if sh.data is not None else 0


def distribute_main_replicas(sharded_state_dict, group=None) -> Optional[List[int]]:
    """In place: each tensor chunk that some rank of ``group`` writes gets exactly one writer among the ranks
    of ``group`` holding it (``replica_id`` 0 there, 1 on the others). Chunks held by one rank stay with it;
    the others go, largest first, to the holder with the fewest bytes so far. Collective over ``group``;
    returns the bytes each rank of ``group`` writes (None outside a multi-rank group)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) <= 1:
        return None
    tensors = [v for _, v in dict_utils.iter_leaves(sharded_state_dict) if isinstance(v, ShardedTensor)]
    local = [(_shard_id(sh), sh.is_main_replica(), _nbytes(sh)) for sh in tensors]
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, local, group=group)
    writer = assign_writers(gathered)
    me = torch.distributed.get_rank(group)
    for sh in tensors:
        chosen = writer.get(_shard_id(sh))
        if chosen is not None:
            sh.replica_id = 0 if chosen == me else 1
    loads = [0] * len(gathered)
    sizes = {sid: n for items in gathered for sid, _, n in items}
    for sid, rank in writer.items():
        loads[rank] += sizes[sid]
    return loads


def assign_writers(gathered: List[list]) -> Dict[ShardId, int]:
    """{shard id: writing rank} from every rank's [(shard id, is main replica, bytes)] (the same answer on
    every rank: it depends on ``gathered`` only). Only chunks that some rank would write are assigned."""
    holders: Dict[ShardId, List[int]] = {}
    sizes: Dict[ShardId, int] = {}
    written = set()
    for rank, items in enumerate(gathered):
        for sid, main, nbytes in items:
            holders.setdefault(sid, []).append(rank)
            sizes[sid] = max(sizes.get(sid, 0), nbytes)
            if main:
                written.add(sid)
    loads = [0] * len(gathered)
    writer = {}
    for sid in sorted(written):
        if len(holders[sid]) == 1:
            writer[sid] = holders[sid][0]
            loads[writer[sid]] += sizes[sid]
    for sid in sorted((s for s in written if len(holders[s]) > 1), key=lambda s: (-sizes[s], s)):
        rank = min(holders[sid], key=lambda r: (loads[r], r))
        writer[sid] = rank
        loads[rank] += sizes[sid]
    return writer
