"""Fully parallel save and load: a tensor that several ranks of a group hold (DP replicas of the weights) is written
once, by one of them, chosen so that every rank of the group writes about the same number of bytes.

Without it the main replica (``replica_id`` 0, DP rank 0) writes every DP-replicated tensor and the other DP
ranks write only their own shards. The files and the checkpoint's content are the same either way; only who
writes which chunk changes. The load does the same for reads: each replicated chunk is read once and
broadcast over the group.
"""
import math
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


def shard_id(sh: ShardedTensor) -> ShardId:
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
    local = [(shard_id(sh), sh.is_main_replica(), _nbytes(sh)) for sh in tensors]
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, local, group=group)
    writer = assign_writers(gathered)
    me = torch.distributed.get_rank(group)
    for sh in tensors:
        chosen = writer.get(shard_id(sh))
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


class FullyParallelLoadStrategyWrapper:
    """Megatron's wrapper for ``dist_checkpointing.load(sharded_strategy=...)``: a tensor chunk that several
    ranks of ``parallelization_group`` request (DP replicas of the weights) is read from storage by one of
    them, the reads spread evenly as in the save, and then broadcast to the others (``exchange_algo``
    'broadcast'; Megatron's other exchange algorithms give the same values). Same loaded values."""

    def __init__(self, strategy=None, parallelization_group=None, do_cache_distribution: bool = False,
                 exchange_algo: str = "broadcast"):
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group


def plan_parallel_reads(tensors: List[ShardedTensor], group=None):
    """(indices of ``tensors`` this rank reads, [(shard id, reading group rank, shape, dtype)] of the chunks
    that several ranks of ``group`` requested, in the order every rank broadcasts them). Collective over
    ``group``; every index and no exchange outside a multi-rank group."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) <= 1:
        return list(range(len(tensors))), []
    local = [(shard_id(sh), True, math.prod(sh.local_shape) * sh.dtype.itemsize) for sh in tensors]
    dtypes = {shard_id(sh): sh.dtype for sh in tensors}
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, (local, dtypes), group=group)
    reader = assign_writers([items for items, _ in gathered])
    holders: Dict[ShardId, int] = {}
    all_dtypes = {}
    for items, types in gathered:
        all_dtypes.update(types)
        for sid, _, _ in items:
            holders[sid] = holders.get(sid, 0) + 1
    me = torch.distributed.get_rank(group)
    mine = [i for i, sh in enumerate(tensors) if reader[shard_id(sh)] == me]
    exchange = [(sid, reader[sid], sid[2], all_dtypes[sid]) for sid in sorted(holders) if holders[sid] > 1]
    return mine, exchange


def exchange_loaded(exchange, buffers: Dict[ShardId, torch.Tensor], group=None, device=None) -> None:
    """Broadcast each chunk of ``exchange`` (plan_parallel_reads) from the rank that read it into ``buffers``
    of the ranks that requested it; a rank that did not request a chunk takes part with a scratch tensor."""
    for sid, src, shape, dtype in exchange:
        buf = buffers.get(sid)
        if buf is None:
            buf = torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(buf, src=torch.distributed.get_global_rank(group, src) if group is not None
                                    else src, group=group)
