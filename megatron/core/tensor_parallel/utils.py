"""Tensor splitting helpers and the vocabulary range of a TP rank."""
from typing import List, Sequence

import torch

from megatron.core.utils import divide


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> List[torch.Tensor]:
    """Split the last dim into ``num_partitions`` equal chunks."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    return [c.contiguous() for c in chunks] if contiguous_split_chunks else list(chunks)


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's chunk of the flattened tensor."""
    flat = tensor.reshape(-1)
    size = divide(flat.numel(), world_size)
    return flat[rank * size:(rank + 1) * size]


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
