"""This rank's process groups, by name: the store behind parallel_state's getters.

``parallel_state.initialize_model_parallel`` computes the rank grid and records each group here
(``GROUPS["tp"]``, ``RANKS["tp"]`` ...); the getters read it back. Optional extra groups live here too:
hierarchical context-parallel sub-groups, power-of-two "hybrid" DP x CP groups, and all-gather
communicators that mirror the DP groups (for overlapping all-gather with reduce-scatter).

This module imports only ``nccl_group_options`` (itself import-free), so anything may read the registry.
"""
from datetime import timedelta
from math import log2
from typing import Dict, List

import numpy as np
import torch

from megatron.core.nccl_group_options import get_nccl_options

# name -> group / global ranks of this rank's group; filled by parallel_state.initialize_model_parallel.
GROUPS: Dict[str, object] = {}
RANKS: Dict[str, List[int]] = {}
# Extra groups and the grids they came from: "dense" / "expert" RankGenerator, "hcp" groups, "hybrid" groups.
EXTRAS: Dict[str, object] = {}
_CREATED_GROUPS: List = []  # every group made by create_group (update_pg_timeout reaches them)


def clear() -> None:
    """Forget every group (the process groups themselves die with the default group)."""
    GROUPS.clear()
    RANKS.clear()
    EXTRAS.clear()


def named_group(name: str):
    """This rank's group called ``name`` (None before initialize_model_parallel)."""
    return GROUPS.get(name)


def named_size(name: str) -> int:
    return len(RANKS[name]) if name in RANKS else 1


def named_rank(name: str) -> int:
    if name not in RANKS:
        return 0
    return RANKS[name].index(torch.distributed.get_rank())


def named_ranks(name: str) -> List[int]:
    """Global ranks of this rank's group ``name``; just this rank when there is no such group."""
    if name in RANKS:
        return list(RANKS[name])
    return [torch.distributed.get_rank() if torch.distributed.is_initialized() else 0]


def create_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                 group_desc=None):
    """torch.distributed.new_group, remembered so that update_pg_timeout can reach it."""
    group = torch.distributed.new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                                        use_local_synchronization=use_local_synchronization,
                                        group_desc=group_desc)
    if ranks is None or torch.distributed.get_rank() in ranks:
        _CREATED_GROUPS.append(group)
    return group


def update_pg_timeout(timeout: timedelta, pg=None):
    """Set the timeout of `pg` (default: the default group and every group from create_group)."""
    set_timeout = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        raise NotImplementedError("update_pg_timeout needs a torch with distributed_c10d._set_pg_timeout")
    torch.distributed.barrier(pg)
    for group in ([pg] if pg is not None else [None] + _CREATED_GROUPS):
        set_timeout(timeout, group)


# ---- extra groups --------------------------------------------------------------------------------------------------

def create_hierarchical_groups(rank, ranks, hierarchical_group_sizes, create_gloo_process_groups=False,
                               pg_options=None, timeout=None, group_desc=None):
    """Sub-groups of `ranks` per level: with sizes [s0, s1, ...] (product = len(ranks)), level k groups
    the ranks that differ only in digit k of the mixed-radix index (s0 fastest). E.g. 8 ranks, [2, 4]:
    level 0 [0,1] [2,3] [4,5] [6,7]; level 1 [0,2,4,6] [1,3,5,7]. Every rank of the world must call
    this; returns this rank's ([group per level], [gloo group or None per level])."""
    sizes = list(hierarchical_group_sizes)
    if int(np.prod(sizes)) != len(ranks):
        raise ValueError(f"hierarchical group sizes {sizes} do not multiply to the {len(ranks)} ranks given")
    if not isinstance(pg_options, list):
        pg_options = [pg_options] * len(sizes)
    groups, gloo_groups = [], []
    for level, size in enumerate(sizes):
        inner, outer = int(np.prod(sizes[:level])), int(np.prod(sizes[level + 1:]))
        # index = (o * size + s) * inner + i: group over s for each (o, i)
        grid = np.array(ranks).reshape(outer, size, inner).transpose(0, 2, 1).reshape(-1, size)
        for sub in grid.tolist():
            group = create_group(sub, timeout=timeout, pg_options=pg_options[level],
                                 group_desc=f"HIERARCHICAL_{group_desc}_L{level}")
            gloo = (create_group(sub, timeout=timeout, backend="gloo",
                                 group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}")
                    if create_gloo_process_groups else None)
            if rank in sub:
                groups.append(group)
                gloo_groups.append(gloo)
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(rank, ranks, pg_options):
    """{size: group}: consecutive blocks of `ranks` for sizes 2, 4, ... up to half the largest power of
    two <= len(ranks) (the full DP x CP group serves the whole size). Every rank of the world must call
    this."""
    out = {}
    for size in [2 ** i for i in range(int(log2(len(ranks))))][1:]:
        for i in range(0, len(ranks), size):
            block = list(ranks[i:i + size])
            group = create_group(block, pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}")
            if rank in block:
                out[size] = group
    return out


def build_extra_groups(dense, expert, hierarchical_context_parallel_sizes, hybrid_context_parallel,
                       create_gloo_process_groups, timeout):
    """The optional groups of initialize_model_parallel, called once its groups exist (every rank calls it);
    ``dense`` / ``expert`` are its two RankGenerators, kept for create_all_gather_groups."""
    EXTRAS.clear()
    EXTRAS["dense"], EXTRAS["expert"] = dense, expert
    rank = torch.distributed.get_rank()
    if hierarchical_context_parallel_sizes:
        if int(np.prod(hierarchical_context_parallel_sizes)) != dense.cp:
            raise ValueError(f"hierarchical_context_parallel_sizes {hierarchical_context_parallel_sizes} must "
                             f"multiply to the context parallel size {dense.cp}")
        for ranks in dense.get_ranks("cp"):
            groups, _ = create_hierarchical_groups(rank, ranks, hierarchical_context_parallel_sizes,
                                                   create_gloo_process_groups=False, timeout=timeout,
                                                   group_desc="CONTEXT_PARALLEL_GROUPS")
            if rank in ranks:
                EXTRAS["hcp"] = groups
    if hybrid_context_parallel:
        hybrid = {}
        for ranks in dense.get_ranks("dp-cp"):
            if len(ranks) % 2:
                raise ValueError("hybrid_context_parallel needs an even number of ranks in each DP x CP group")
            mine = create_hybrid_dp_cp_groups(rank, ranks, None)
            if rank in ranks:
                hybrid = mine
        EXTRAS["hybrid"] = hybrid


def _require_grid():
    if "dense" not in EXTRAS or "tp" not in GROUPS:
        raise RuntimeError("parallel_state is not initialized; call initialize_model_parallel() first")


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's CP sub-groups, one per level of initialize_model_parallel's
    hierarchical_context_parallel_sizes (None when it was not given)."""
    groups = EXTRAS.get("hcp")
    if check_initialized and groups is None:
        raise RuntimeError("no hierarchical context-parallel groups: pass hierarchical_context_parallel_sizes "
                           "to initialize_model_parallel")
    return groups


def get_hybrid_data_context_parallel_groups(check_initialized=True, group_size=None):
    """The DP x CP sub-group of `group_size` ranks holding this rank (the full DP x CP group for its size)."""
    if group_size == named_size("dp_cp"):
        return named_group("dp_cp")
    hybrid = EXTRAS.get("hybrid") or {}
    if group_size not in hybrid:
        if not check_initialized:
            return None
        raise RuntimeError(f"no hybrid DP x CP group of size {group_size}: initialize_model_parallel("
                           f"hybrid_context_parallel=True) builds sizes {sorted(hybrid) or 'none yet'}")
    return hybrid[group_size]


def create_all_gather_groups(for_expert_parallelism=False, timeout=None, nccl_comm_cfgs=None):
    """New communicators over the same ranks as the DP x CP groups (and, with `for_expert_parallelism`
    and EP > 1, the expert-DP groups), so all-gathers can run beside reduce-scatters on the DP groups.
    Returns this rank's (dp_cp_ag_group, expt_dp_ag_group or None)."""
    _require_grid()
    rank, cfgs = torch.distributed.get_rank(), nccl_comm_cfgs or {}
    dp_cp_ag = expt_dp_ag = None
    for ranks in EXTRAS["dense"].get_ranks("dp-cp"):
        group = create_group(ranks, timeout=timeout, pg_options=get_nccl_options("dp_cp", cfgs),
                             group_desc="DATA_PARALLEL_GROUP_WITH_CP_AG")
        if rank in ranks:
            dp_cp_ag = group
    if for_expert_parallelism and EXTRAS["expert"].ep > 1:
        for ranks in EXTRAS["expert"].get_ranks("dp"):
            group = create_group(ranks, timeout=timeout, pg_options=get_nccl_options("ep_dp", cfgs),
                                 group_desc="EXPERT_DATA_PARALLEL_GROUP_AG")
            if rank in ranks:
                expt_dp_ag = group
    return dp_cp_ag, expt_dp_ag
