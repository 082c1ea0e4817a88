"""Are the parameters that the parallel layout replicates still bitwise identical on every rank holding a copy?

Silent hardware faults (a flipped bit in memory, a corrupted message, a bad checkpoint read) leave one
rank's copy different from its peers' without any error; training then goes on from replicas that
disagree. This compares a fingerprint of each replicated parameter over the group that replicates it:

- ``dp``: every dense parameter over the data-parallel group (with the context-parallel ranks, which
  hold the same weights); ``edp``: expert parameters (``allreduce = False``) over the expert
  data-parallel group, since different expert-parallel ranks own different experts;
- ``tp``: parameters that tensor parallelism does not split (no ``tensor_model_parallel`` attribute:
  norms, row-parallel biases, routers, position embeddings) over the tensor-parallel group; ``etp``:
  the unsplit expert parameters over the expert tensor-parallel group.

The fingerprint is exact for bit flips and runs on the parameter's device: the bits read as integers,
their sum and their position-weighted sum (int64, wrapping). A single changed bit moves the weighted
sum by ``2**k * (i + 1)``, never 0 modulo ``2**64``; swapped elements move it too. Used by --test-mode.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import get_device

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements per int64 widening: bounds the temporary memory to 128 MiB per buffer


@torch.no_grad()
def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """[sum of the elements' bits as integers, sum of bits * (position + 1)], int64 on the tensor's device."""
    flat = tensor.detach().contiguous().view(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).view(-1)
    words = flat.view(_INT_OF_SIZE[flat.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=flat.device)
        out[0] += w.sum()
        out[1] += (w * pos).sum()
    return out


def _label_and_groups(dp_group=None, edp_group=None, tp_group=None, etp_group=None) -> Dict[str, object]:
    """The four replication groups, defaulting to parallel_state's."""
    if dp_group is None:
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if edp_group is None:
        edp_group = parallel_state.get_expert_data_parallel_group()
    if etp_group is None:
        etp_group = parallel_state.get_expert_tensor_parallel_group()
    return {"dp": dp_group, "edp": edp_group, "tp": tp_group, "etp": etp_group}


def replicated_params(model) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
    """{group label: [(name, param)]} of the parameters each group replicates. ``model``: a module or a
    list of model chunks (names get a ``chunkN.`` prefix when there are several)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = {"dp": [], "edp": [], "tp": [], "etp": []}
    for i, chunk in enumerate(chunks):
        prefix = f"chunk{i}." if len(chunks) > 1 else ""
        for name, p in chunk.named_parameters():
            expert = not getattr(p, "allreduce", True)
            out["edp" if expert else "dp"].append((prefix + name, p))
            if not getattr(p, "tensor_model_parallel", False):
                out["etp" if expert else "tp"].append((prefix + name, p))
    return out


def gather_fingerprints(named: Sequence[Tuple[str, torch.Tensor]], group,
                        fingerprint_fn: Callable[[torch.Tensor], torch.Tensor] = fingerprint) -> Optional[torch.Tensor]:
    """[group size, n, k] (on the host): every rank's ``fingerprint_fn`` of each of the ``named`` parameters, in
    the group's rank order; None when there is nothing to compare (no parameters, no group, one rank)."""
    if not named or group is None or dist.get_world_size(group) == 1:
        return None
    local = torch.stack([fingerprint_fn(p).to(get_device()) for _, p in named])  # [n, k]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered).cpu()  # one device-to-host copy


def _first_mismatch(label: str, named: Sequence[Tuple[str, torch.Tensor]], group) -> Optional[str]:
    """Description of the first parameter whose fingerprint differs within ``group``, else None."""
    table = gather_fingerprints(named, group)
    if table is None:
        return None
    ranks = dist.get_process_group_ranks(group)
    for i, (name, _) in enumerate(named):
        odd = [ranks[r] for r in range(len(ranks)) if not torch.equal(table[r, i], table[0, i])]
        if odd:
            who = f"rank {odd[0]}" if len(odd) == 1 else "ranks " + ", ".join(map(str, odd))
            return (f"parameter {name} differs across the {label} group (ranks {ranks}): {who} "
                    f"{'does' if len(odd) == 1 else 'do'} not match rank {ranks[0]}")
    return None


def find_replica_mismatch(model, dp_group=None, edp_group=None, tp_group=None, etp_group=None) -> Optional[str]:
    """One line naming a replicated parameter that differs (the group, the ranks), or None; the same answer on
    every rank (a mismatch seen in one group is sent to all). A collective over every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    groups = _label_and_groups(dp_group, edp_group, tp_group, etp_group)
    message = None
    for label, named in replicated_params(model).items():
        found = _first_mismatch(label, named, groups[label])
        message = message or found
    rank, world = dist.get_rank(), dist.get_world_size()
    reporter = torch.tensor([rank if message else world], dtype=torch.int64, device=get_device())
    dist.all_reduce(reporter, op=dist.ReduceOp.MIN)
    src = int(reporter.item())
    if src == world:
        return None
    box = [message]
    dist.broadcast_object_list(box, src=src)
    return box[0]
