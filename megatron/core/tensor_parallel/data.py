"""Broadcast a batch from TP rank 0 to the other ranks of its TP group."""
import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import get_device


def broadcast_data(keys: List[str], data: Dict[str, torch.Tensor], datatype: torch.dtype,
                   tp_group=None, shapes: Optional[Dict[str, Sequence[int]]] = None) -> Dict[str, torch.Tensor]:
    """Return ``{key: tensor}`` on every TP rank; only TP rank 0 needs ``data``. Sizes go first, then one
    flattened buffer, so only two broadcasts are issued. With ``shapes`` (every key's shape, known on every
    rank) only the buffer is broadcast and nothing waits for the device: reading the sizes back is a host
    synchronisation that stops the host from queueing work ahead of the GPU, once per micro-batch."""
    device = get_device()
    group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        # non_blocking: the loader pins its batches, and a blocking copy from pinned memory waits for the
        # device (a host synchronisation per tensor per micro-batch).
        return {k: data[k].to(device=device, dtype=datatype, non_blocking=True) for k in keys}
    src = dist.get_process_group_ranks(group)[0]
    is_src = group.rank() == 0
    if shapes is not None:
        return _broadcast_known_shapes(keys, data, datatype, group, src, is_src, shapes, device)
    max_dims = 8
    sizes = torch.zeros(len(keys), max_dims, dtype=torch.long, device=device)
    if is_src:
        for i, k in enumerate(keys):
            if data[k].dim() > max_dims:
                raise ValueError(f"broadcast_data: '{k}' has more than {max_dims} dims")
            if data[k].dtype != datatype:
                raise ValueError(f"broadcast_data: '{k}' has dtype {data[k].dtype}, expected {datatype}")
            sizes[i, :data[k].dim()] = torch.tensor(data[k].shape)
    dist.broadcast(sizes, src, group=group)
    shapes = [tuple(int(d) for d in row if d > 0) for row in sizes.tolist()]
    return _broadcast_flat(keys, data, datatype, group, src, is_src, shapes, device)


def _broadcast_known_shapes(keys, data, datatype, group, src, is_src, shapes, device):
    shapes = [tuple(int(d) for d in shapes[k]) for k in keys]
    if is_src:
        for k, shape in zip(keys, shapes):
            if tuple(data[k].shape) != shape:
                raise ValueError(f"broadcast_data: '{k}' has shape {tuple(data[k].shape)}, the other TP ranks "
                                 f"expect {shape}")
            if data[k].dtype != datatype:
                raise ValueError(f"broadcast_data: '{k}' has dtype {data[k].dtype}, expected {datatype}")
    return _broadcast_flat(keys, data, datatype, group, src, is_src, shapes, device)


def _broadcast_flat(keys, data, datatype, group, src, is_src, shapes, device):
    """One broadcast of every key's tensor flattened into a buffer; views of it in ``shapes`` on every rank."""
    numels = [math.prod(s) for s in shapes]
    if is_src:
        flat = torch.cat([data[k].reshape(-1).to(device, non_blocking=True) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    out, offset = {}, 0
    for k, shape, n in zip(keys, shapes, numels):
        out[k] = flat[offset:offset + n].view(shape)
        offset += n
    return out
