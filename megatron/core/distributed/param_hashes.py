"""Are the data-parallel replicas still identical? Every parameter's SHA-1 (of its bytes, on the host) is
all-gathered over the group that replicates it (the data-parallel group; the expert data-parallel group for
expert parameters, which have ``allreduce = False``) and compared, so a replica that drifted (a missed gradient
reduction, a non-deterministic update, a bad node) is found, with the names of the parameters that differ.
Used by ``--check-weight-hash-across-dp-replicas-interval``; costs a device-to-host copy of every parameter."""
import hashlib
from typing import List, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import get_device


def _sha1(param: torch.Tensor) -> torch.Tensor:
    data = param.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return torch.frombuffer(bytearray(hashlib.sha1(data.tobytes()).digest()), dtype=torch.uint8)


def _mismatches(named, group) -> List[str]:
    """Names of ``named`` parameters whose hash differs on some rank of ``group``."""
    if not named or group is None or dist.get_world_size(group) == 1:
        return []
    local = torch.stack([_sha1(p) for _, p in named]).to(get_device())  # [n, 20]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    differs = torch.zeros(len(named), dtype=torch.bool, device=local.device)
    for other in gathered:
        differs |= (other != local).any(dim=1)
    return [name for (name, _), bad in zip(named, differs.tolist()) if bad]


def param_hashes_match_across_dp(model, dp_group=None, expert_dp_group=None) -> Tuple[bool, List[str]]:
    """(every replica identical, names of the parameters that differ on this rank's replica groups).
    The verdict is agreed over all ranks, so every rank returns the same bool. ``model``: a module or a list of
    model chunks (names are prefixed with the chunk index when there are several)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    dense, expert = [], []
    for i, chunk in enumerate(chunks):
        prefix = f"chunk{i}." if len(chunks) > 1 else ""
        for name, p in chunk.named_parameters():
            (dense if getattr(p, "allreduce", True) else expert).append((prefix + name, p))
    if dp_group is None:
        dp_group = parallel_state.get_data_parallel_group()
    if expert and expert_dp_group is None:
        expert_dp_group = parallel_state.get_expert_data_parallel_group()
    bad = _mismatches(dense, dp_group) + _mismatches(expert, expert_dp_group)
    ok = torch.tensor(0 if bad else 1, device=get_device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item()), bad
