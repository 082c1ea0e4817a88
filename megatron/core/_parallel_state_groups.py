"""Megatron's optional extra process groups (re-exported by megatron/core/parallel_state.py):
hierarchical context-parallel sub-groups, power-of-two "hybrid" DP x CP groups, and all-gather
communicators that mirror the DP groups (for overlapping all-gather with reduce-scatter)."""
from math import log2
from typing import Dict, List

import numpy as np
import torch

from megatron.core import parallel_state as _ps
from megatron.core._parallel_state_extras import create_group

__all__ = ["create_hierarchical_groups", "create_hybrid_dp_cp_groups", "create_all_gather_groups",
           "get_hierarchical_context_parallel_groups", "get_hybrid_data_context_parallel_groups"]
_STATE: Dict[str, object] = {}  # dense / expert RankGenerator, hcp groups, hybrid groups


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
            gloo = (create_group(sub, timeout=timeout, backend="gloo", group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}")
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


def build_grid_extras(dense, expert, hierarchical_context_parallel_sizes, hybrid_context_parallel,
                      create_gloo_process_groups, timeout):
    """Called by initialize_model_parallel after its groups exist."""
    _STATE.clear()
    _STATE["dense"], _STATE["expert"] = dense, expert
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
                _STATE["hcp"] = groups
    if hybrid_context_parallel:
        hybrid = {}
        for ranks in dense.get_ranks("dp-cp"):
            if len(ranks) % 2:
                raise ValueError("hybrid_context_parallel needs an even number of ranks in each DP x CP group")
            mine = create_hybrid_dp_cp_groups(rank, ranks, None)
            if rank in ranks:
                hybrid = mine
        _STATE["hybrid"] = hybrid


def _require_grid():
    if "dense" not in _STATE or not _ps.model_parallel_is_initialized():
        raise RuntimeError("parallel_state is not initialized; call initialize_model_parallel() first")


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's CP sub-groups, one per level of initialize_model_parallel's
    hierarchical_context_parallel_sizes (None when it was not given)."""
    groups = _STATE.get("hcp")
    if check_initialized and groups is None:
        raise RuntimeError("no hierarchical context-parallel groups: pass hierarchical_context_parallel_sizes "
                           "to initialize_model_parallel")
    return groups


def get_hybrid_data_context_parallel_groups(check_initialized=True, group_size=None):
    """The DP x CP sub-group of `group_size` ranks holding this rank (the full DP x CP group for its size)."""
    if group_size == _ps.get_data_parallel_world_size(with_context_parallel=True):
        return _ps.get_data_parallel_group(with_context_parallel=True)
    hybrid = _STATE.get("hybrid") or {}
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
    from megatron.core._parallel_state_extras import get_nccl_options
    rank, cfgs = torch.distributed.get_rank(), nccl_comm_cfgs or {}
    dp_cp_ag = expt_dp_ag = None
    for ranks in _STATE["dense"].get_ranks("dp-cp"):
        group = create_group(ranks, timeout=timeout, pg_options=get_nccl_options("dp_cp", cfgs),
                             group_desc="DATA_PARALLEL_GROUP_WITH_CP_AG")
        if rank in ranks:
            dp_cp_ag = group
    if for_expert_parallelism and _STATE["expert"].ep > 1:
        for ranks in _STATE["expert"].get_ranks("dp"):
            group = create_group(ranks, timeout=timeout, pg_options=get_nccl_options("ep_dp", cfgs),
                                 group_desc="EXPERT_DATA_PARALLEL_GROUP_AG")
            if rank in ranks:
                expt_dp_ag = group
    return dp_cp_ag, expt_dp_ag
