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
from megatron.core.distributed.replica_checks import gather_fingerprints, replicated_params
from megatron.core.utils import get_device


def _sha1(param: torch.Tensor) -> torch.Tensor:
    data = param.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return torch.frombuffer(bytearray(hashlib.sha1(data.tobytes()).digest()), dtype=torch.uint8)


def _mismatches(named, group) -> List[str]:
    """Names of ``named`` parameters whose hash differs on some rank of ``group`` from this rank's."""
    table = gather_fingerprints(named, group, _sha1)  # [group size, n, 20]
    if table is None:
        return []
    differs = (table != table[dist.get_rank(group)]).any(dim=2).any(dim=0)
    return [name for (name, _), bad in zip(named, differs.tolist()) if bad]


def param_hashes_match_across_dp(model, dp_group=None, expert_dp_group=None) -> Tuple[bool, List[str]]:
    """(every replica identical, names of the parameters that differ on this rank's replica groups).
    The verdict is agreed over all ranks, so every rank returns the same bool. ``model``: a module or a list of
    model chunks (names are prefixed with the chunk index when there are several)."""
    named = replicated_params(model)
    if dp_group is None:
        dp_group = parallel_state.get_data_parallel_group()
    if named["edp"] and expert_dp_group is None:
        expert_dp_group = parallel_state.get_expert_data_parallel_group()
    bad = _mismatches(named["dp"], dp_group) + _mismatches(named["edp"], expert_dp_group)
    ok = torch.tensor(0 if bad else 1, device=get_device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item()), bad
