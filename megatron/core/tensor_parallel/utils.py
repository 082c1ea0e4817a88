"""Tensor splitting helpers and the vocabulary range of a TP rank."""
from typing import List, Optional, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.utils import divide


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> List[torch.Tensor]:
    """Split the last dim into ``num_partitions`` equal chunks."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    return [c.contiguous() for c in chunks] if contiguous_split_chunks else list(chunks)


def _tp_group_if_none(tp_group):
    return tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group(
        check_initialized=False)


def _rank_and_size(group, rank, world_size):
    if rank is not None and world_size is not None:
        return rank, world_size
    if group is None:  # no TP group (single process): the whole tensor is this rank's chunk
        return 0, 1
    return group.rank(), group.size()


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False, tp_group=None,
                                      *, rank: Optional[int] = None,
                                      world_size: Optional[int] = None) -> torch.Tensor:
    """This TP rank's 1/world_size of the flattened tensor (a view, or a copy with `new_buffer`).

    `rank`/`world_size` override the group's, for callers that split without a process group."""
    if rank is None or world_size is None:
        rank, world_size = _rank_and_size(_tp_group_if_none(tp_group), rank, world_size)
    flat = tensor.reshape(-1)
    size = divide(flat.numel(), world_size)
    chunk = flat[rank * size:(rank + 1) * size]
    return chunk.clone() if new_buffer else chunk


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Inverse of split_tensor_into_1d_equal_chunks: all-gather the TP ranks' chunks, flattened."""
    tp_group = _tp_group_if_none(tp_group)
    if tp_group is None or tp_group.size() == 1:
        return tensor.reshape(-1).clone()
    gathered = torch.empty(tensor.numel() * tp_group.size(), dtype=tensor.dtype, device=tensor.device)
    # all_gather into views of one buffer (gloo has no all_gather_into_tensor)
    torch.distributed.all_gather(list(gathered.chunk(tp_group.size())), tensor.contiguous().reshape(-1),
                                 group=tp_group)
    return gathered


class VocabUtility:
    """[first, last) vocabulary ids owned by a TP rank (the vocab is split into equal ranges)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Sequence[int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Sequence[int]:
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
