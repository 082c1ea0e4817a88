"""Our torch_dist checkpoints as global tensors, in one process (no process group needed).

A torch_dist checkpoint stores every tensor under its global (TP=PP=1) key, so a converter can write
whole tensors here and any TP/PP layout reads its slices back (see dist_checkpointing/mapping.py).
"""
from typing import Dict, Iterable, List, Tuple

import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy


def _sharded(key: str, t: torch.Tensor, stride: int) -> ShardedTensor:
    if stride > 1:  # [stride * n, ...] -> [stride, n, ...], as sharded_state.py describes strided params
        t = t.reshape(stride, t.shape[0] // stride, *t.shape[1:])
    return ShardedTensor(key, t, t.dtype, tuple(t.shape), tuple(t.shape), (0,) * t.dim(), (1,) * t.dim())


def save_global(tensors: Iterable[Tuple[str, torch.Tensor, int]], checkpoint_dir: str, common: Dict) -> None:
    """Write (global name, tensor, stride) triples plus ``common`` (args, iteration...) as torch_dist."""
    model = {name: _sharded(name, t, stride) for name, t, stride in tensors}
    dist_checkpointing.save(dict(common, model=model), checkpoint_dir)


def read_global(checkpoint_dir: str, names: List[Tuple[str, int]], metadata: Dict) -> Dict[str, torch.Tensor]:
    """Read whole global tensors (name, stride); strided ones ([k, n, ...]) come back as [k * n, ...]."""
    shards, strides = {}, dict(names)
    for name, _ in names:
        if name not in metadata:
            raise KeyError(f"checkpoint {checkpoint_dir} has no tensor {name} (not the architecture it claims?)")
        shape, dtype = metadata[name]
        shards[name] = [((0,) * len(shape), torch.empty(shape, dtype=dtype), tuple(shape))]
    torch_strategy.dcp_read(checkpoint_dir, shards, [], no_dist=True)
    out = {}
    for name, [(_, t, _)] in shards.items():
        out[name] = t.reshape(-1, *t.shape[2:]) if strides[name] > 1 else t
    return out
