"""Broadcast a batch from TP rank 0 to the other ranks of its TP group."""
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import get_device


def broadcast_data(keys: List[str], data: Dict[str, torch.Tensor], datatype: torch.dtype,
                   tp_group=None) -> Dict[str, torch.Tensor]:
    """Return ``{key: tensor}`` on every TP rank; only TP rank 0 needs ``data``. Sizes go first, then one
    flattened buffer, so only two broadcasts are issued."""
    device = get_device()
    group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return {k: data[k].to(device=device, dtype=datatype) for k in keys}
    src = dist.get_process_group_ranks(group)[0]
    is_src = group.rank() == 0
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
    shapes = [[int(d) for d in row if d > 0] for row in sizes.tolist()]
    numels = [int(torch.tensor(s).prod()) if s else 0 for s in shapes]
    if is_src:
        flat = torch.cat([data[k].reshape(-1).to(device) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    out, offset = {}, 0
    for k, shape, n in zip(keys, shapes, numels):
        out[k] = flat[offset:offset + n].view(shape)
        offset += n
    return out
