"""Megatron-only names of ``megatron.core.parallel_state``, reached through its lazy alias table.

Fixed-answer getters (weight-rematerialisation groups of size 1, a single distributed-optimizer
instance), Megatron's rank helpers nothing here calls, and the process-wide GlobalMemoryBuffer.
"""
import torch

from megatron.core import parallel_state
from megatron.core._compat.utils import GlobalMemoryBuffer
from megatron.core.process_group_registry import named_rank, named_ranks

_GLOBAL_MEMORY_BUFFER = None


def is_initialized() -> bool:
    """Whether the data-parallel group exists (initialize_model_parallel ran)."""
    return parallel_state.get_data_parallel_group() is not None


def get_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's model-parallel (tp x pp) group."""
    return named_ranks("mp")[0]


def get_expert_model_parallel_src_rank() -> int:
    return named_ranks("ep")[0]


def get_all_ranks() -> str:
    """'tp_gtp_dp_cp_pp_ep' ranks of this process, as Megatron logs them (gtp is always 0 here)."""
    ranks = [parallel_state.get_tensor_model_parallel_rank(), 0, parallel_state.get_data_parallel_rank(),
             parallel_state.get_context_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
             parallel_state.get_expert_model_parallel_rank()]
    return "_".join(str(r or 0) for r in ranks)


def default_embedding_ranks(pp_ranks):
    """First and last pipeline stage hold the (tied) word embeddings."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks):
    """Only the first pipeline stage holds learned position embeddings."""
    return [pp_ranks[0]]


def get_tensor_and_context_parallel_rank() -> int:
    return named_rank("tp_cp")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return named_rank("tp_ep")


def get_global_memory_buffer():
    """The process-wide GlobalMemoryBuffer (created on first use)."""
    global _GLOBAL_MEMORY_BUFFER
    if _GLOBAL_MEMORY_BUFFER is None:
        _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    return _GLOBAL_MEMORY_BUFFER


def destroy_global_memory_buffer():
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set one (key, value) of `pg_name`'s entry in an NCCL communicator config dict."""
    nccl_comm_cfgs.setdefault(pg_name, {})[key_value_pair[0]] = key_value_pair[1]


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
