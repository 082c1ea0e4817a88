"""Less common parallel_state names (re-exported by megatron/core/parallel_state.py)."""
import logging
from datetime import timedelta
from typing import List, Optional

import torch

from megatron.core import parallel_state as _ps

logger = logging.getLogger(__name__)
__all__ = ["is_initialized", "get_model_parallel_src_rank", "get_expert_model_parallel_src_rank", "get_all_ranks",
           "default_embedding_ranks", "default_position_embedding_ranks", "get_tensor_and_context_parallel_rank",
           "get_expert_tensor_and_model_parallel_rank", "get_global_memory_buffer",
           "destroy_global_memory_buffer", "create_group", "update_pg_timeout", "get_nccl_options",
           "overwrite_nccl_comm_cfgs", "get_intra_distributed_optimizer_instance_group",
           "get_inter_distributed_optimizer_instance_group", "get_gtp_weight_remat_group",
           "get_gtp_weight_remat_world_size", "get_gtp_weight_remat_rank", "get_gtp_weight_remat_global_ranks",
           "get_expert_gtp_weight_remat_group", "get_expert_gtp_weight_remat_world_size",
           "get_expert_gtp_weight_remat_rank", "get_expert_gtp_weight_remat_global_ranks"]
_GLOBAL_MEMORY_BUFFER = None
_CREATED_GROUPS: List = []


def is_initialized() -> bool:
    """Whether the data-parallel group exists (initialize_model_parallel ran)."""
    return _ps.get_data_parallel_group() is not None


def get_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's model-parallel (tp x pp) group."""
    return _ps._ranks("mp")[0]


def get_expert_model_parallel_src_rank() -> int:
    return _ps._ranks("ep")[0]


def get_all_ranks() -> str:
    """'tp_gtp_dp_cp_pp_ep' ranks of this process, as Megatron logs them (gtp is always 0 here)."""
    ranks = [_ps.get_tensor_model_parallel_rank(), 0, _ps.get_data_parallel_rank(),
             _ps.get_context_parallel_rank(), _ps.get_pipeline_model_parallel_rank(),
             _ps.get_expert_model_parallel_rank()]
    return "_".join(str(r or 0) for r in ranks)


def default_embedding_ranks(pp_ranks):
    """First and last pipeline stage hold the (tied) word embeddings."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks):
    """Only the first pipeline stage holds learned position embeddings."""
    return [pp_ranks[0]]


def get_tensor_and_context_parallel_rank() -> int:
    return _ps._rank("tp_cp")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _ps._rank("tp_ep")


def get_global_memory_buffer():
    """The process-wide GlobalMemoryBuffer (created on first use)."""
    global _GLOBAL_MEMORY_BUFFER
    if _GLOBAL_MEMORY_BUFFER is None:
        from megatron.core.utils import GlobalMemoryBuffer
        _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    return _GLOBAL_MEMORY_BUFFER


def destroy_global_memory_buffer():
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


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


def get_nccl_options(pg_name, nccl_comm_cfgs):
    """ProcessGroupNCCL.Options for `pg_name` from a --nccl-communicator-config-path dict, else None."""
    cfg = nccl_comm_cfgs.get(pg_name)
    if cfg is None:
        return None
    options = torch.distributed.ProcessGroupNCCL.Options(
        is_high_priority_stream=cfg.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    if "net_name" in cfg and cfg["net_name"].lower() not in ("ib", "socket"):
        raise ValueError(f"NCCL config for {pg_name}: net_name '{cfg['net_name']}' must be IB or socket")
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set one (key, value) of `pg_name`'s entry in an NCCL communicator config dict."""
    nccl_comm_cfgs.setdefault(pg_name, {})[key_value_pair[0]] = key_value_pair[1]


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    """With one distributed-optimizer instance (the only layout here) it spans the dp x cp group."""
    return _ps.get_data_parallel_group(with_context_parallel=True)


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """None: there is a single distributed-optimizer instance (num_distributed_optimizer_instances=1)."""
    return None


# Weight-rematerialisation (gtp_remat) groups: initialize_model_parallel refuses gtp_remat_size > 1, so
# each rank is its own group: size 1, rank 0, no process group object (get_pg_size(None) == 1).
def get_gtp_weight_remat_group(check_initialized=True):
    return None


def get_gtp_weight_remat_world_size():
    return 1


def get_gtp_weight_remat_rank():
    return 0


def get_gtp_weight_remat_global_ranks(check_initialized=True):
    return [torch.distributed.get_rank() if torch.distributed.is_initialized() else 0]


get_expert_gtp_weight_remat_group = get_gtp_weight_remat_group
get_expert_gtp_weight_remat_world_size = get_gtp_weight_remat_world_size
get_expert_gtp_weight_remat_rank = get_gtp_weight_remat_rank
get_expert_gtp_weight_remat_global_ranks = get_gtp_weight_remat_global_ranks
