"""Our torch_dist checkpoints as global tensors, in one process (no process group needed).

A torch_dist checkpoint stores every tensor under its global (TP=PP=1) key, so a converter can write
whole tensors here and any TP/PP layout reads its slices back (see dist_checkpointing/mapping.py).
Writing is lazy: DCP plans from shapes alone and asks for each tensor only when it writes it, one
file per tensor, so converting holds about one tensor at a time (DCP keeps a file's tensors until the
file is closed).
"""
import os
import warnings
from typing import Callable, Dict, Iterable, List, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from megatron.core.dist_checkpointing.core import save_config
from megatron.core.dist_checkpointing.serialization import COMMON_FNAME
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

# (global name, shape, dtype, stride, make): ``make()`` returns the tensor when DCP writes it
LazyTensor = Tuple[str, Tuple[int, ...], torch.dtype, int, Callable[[], torch.Tensor]]


def _strided_shape(shape, stride):
    """[stride * n, ...] -> [stride, n, ...], as sharded_state.py describes strided params (gated fc1)."""
    return tuple(shape) if stride == 1 else (stride, shape[0] // stride) + tuple(shape[1:])


class _LazySavePlanner(torch_strategy._SavePlanner):
    def __init__(self, shards, makers):
        super().__init__(shards)
        self.makers = makers

    def lookup_object(self, index):
        if index.fqn in self.makers:
            shape = self.shards[index.fqn][0][1].shape
            return self.makers[index.fqn]().reshape(shape)
        return super().lookup_object(index)


def save_global(tensors: Iterable[LazyTensor], checkpoint_dir: str, common: Dict) -> None:
    """Write lazily made global tensors plus ``common`` (args, iteration...) as a torch_dist checkpoint."""
    shards, makers = {}, {}
    for name, shape, dtype, stride, make in tensors:
        shape = _strided_shape(shape, stride)
        shards[name] = [((0,) * len(shape), torch.empty(shape, dtype=dtype, device="meta"), shape)]
        makers[name] = make
    os.makedirs(checkpoint_dir, exist_ok=True)
    torch.save(common, os.path.join(checkpoint_dir, COMMON_FNAME))
    writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=False, thread_count=1)
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: intended here
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp_save({}, storage_writer=writer, planner=_LazySavePlanner(shards, makers), no_dist=True)
    save_config(None, checkpoint_dir)  # metadata.json last: marks the checkpoint complete


def read_global(checkpoint_dir: str, names: List[Tuple[str, int]], metadata: Dict) -> Dict[str, torch.Tensor]:
    """Read whole global tensors (name, stride); strided ones ([k, n, ...]) come back as [k * n, ...]."""
    shards, strides = {}, dict(names)
    for name, _ in names:
        if name not in metadata:
            raise KeyError(f"checkpoint {checkpoint_dir} has no tensor {name} (not the architecture it claims?)")
        entry = metadata[name]  # a data-less ShardedTensor (load_tensors_metadata) or (shape, dtype)
        shape, dtype = (entry.global_shape, entry.dtype) if hasattr(entry, "global_shape") else entry
        shards[name] = [((0,) * len(shape), torch.empty(shape, dtype=dtype), tuple(shape))]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        torch_strategy.dcp_read(checkpoint_dir, shards, [], no_dist=True)
    out = {}
    for name, [(_, t, _)] in shards.items():
        out[name] = t.reshape(-1, *t.shape[2:]) if strides[name] > 1 else t
    return out
