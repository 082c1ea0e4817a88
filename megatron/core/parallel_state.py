"""The rank grid and every process group, with Megatron's getter names.

Global rank = mixed-radix number over the order string (default ``tp-cp-ep-dp-pp``), first token fastest.
A group of type "x-y" holds the ranks that differ only in their x and y digits. Two grids share the PP
axis: the dense one (tp, cp, dp, pp) and the expert one (expert-tp, ep, expert-dp, pp).

Without ``initialize_model_parallel`` (e.g. a single-process unit test) every size getter returns 1,
every rank getter 0 and every group getter None, so models build and run unchanged on one process.
"""
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from megatron.core.nccl_group_options import (  # noqa: F401  (get_nccl_options: Megatron's name)
    get_nccl_options,
    megatron_group_name,
    nccl_group_configs,
)
from megatron.core.process_group_registry import GROUPS as _GROUPS  # this rank's groups by name
from megatron.core.process_group_registry import RANKS as _RANKS  # ... and their global ranks
from megatron.core.process_group_registry import build_extra_groups as _build_extra_groups
from megatron.core.process_group_registry import clear as _clear_groups
from megatron.core.process_group_registry import (  # noqa: F401  (Megatron's names for the extra groups)
    create_all_gather_groups,
    create_group,
    create_hierarchical_groups,
    create_hybrid_dp_cp_groups,
    get_hierarchical_context_parallel_groups,
    get_hybrid_data_context_parallel_groups,
    update_pg_timeout,
)
from megatron.core.process_group_registry import named_group as _group
from megatron.core.process_group_registry import named_rank as _rank
from megatron.core.process_group_registry import named_ranks as _ranks
from megatron.core.process_group_registry import named_size as _size
from megatron.core.utils import lazy_names

_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: Optional[int] = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: Optional[int] = None
# Test/override hooks, as in Megatron (set_tensor_model_parallel_world_size etc.).
_OVERRIDES: Dict[str, int] = {}


class RankGenerator:
    """Enumerates the rank groups of a grid with sizes tp, ep, dp, pp, cp laid out by ``order``."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0,
                 gtp_remat: int = 1):
        if gtp_remat != 1:
            raise NotImplementedError("RankGenerator(gtp_remat > 1): weight rematerialisation groups are not "
                                      "supported; leave it at 1")
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        tokens = order.lower().split("-")
        for tok in tokens:
            if tok not in self.name_to_size:
                raise ValueError(f"order '{order}': unknown token '{tok}'; use tokens from tp, cp, ep, dp, pp")
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"order '{order}' repeats a token")
        for name, size in self.name_to_size.items():
            if name not in tokens:
                if size != 1:
                    raise ValueError(f"order '{order}' lacks '{name}' whose size is {size}")
                tokens.append(name)  # size-1 axes may be omitted from the order string
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> List[bool]:
        wanted = token.split("-")
        return [t in wanted for t in order.split("-")]

    def get_ranks(self, token: str) -> List[List[int]]:
        """All groups of type ``token`` (e.g. 'tp-pp'), each a list of global ranks."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[r + self.rank_offset for r in g] for g in groups]


def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size: List[int], mask: List[bool]):
    """Groups of ranks that vary only along the masked axes; axis 0 is the fastest digit."""
    assert int(np.prod(parallel_size)) == world_size
    # C order makes the last axis fastest, so reverse the sizes: arr[..., d0] with d0 fastest.
    grid = np.arange(world_size).reshape(parallel_size[::-1])
    n = len(parallel_size)
    # Grid axis of digit i is n-1-i; list slower digits first so the fastest digit is the last axis.
    unmasked = [n - 1 - i for i in reversed(range(n)) if not mask[i]]
    masked = [n - 1 - i for i in reversed(range(n)) if mask[i]]
    group_size = int(np.prod([parallel_size[i] for i in range(len(mask)) if mask[i]]))
    # [groups, group_size]: first unmasked digit fastest across groups, first masked digit fastest within.
    return grid.transpose(unmasked + masked).reshape(-1, group_size).tolist()


def _check_unsupported(**kwargs):
    for name, (value, default) in kwargs.items():
        if value != default:
            raise NotImplementedError(f"initialize_model_parallel({name}={value!r}) is not supported; "
                                      f"leave it at {default!r}")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    rank_offset: int = 0,
    local_world_size: Optional[int] = None,
) -> None:
    """Build every process group for the given degrees (all ranks must call this in the same order).

    `hierarchical_context_parallel_sizes` / `hybrid_context_parallel` build Megatron's extra CP groups
    (get_hierarchical_context_parallel_groups, which cp_comm_type a2a+p2p attends over /
    get_hybrid_data_context_parallel_groups, whose dynamic CP is not implemented). `local_world_size` (GPUs per
    node, for NCCL tuning) has no effect here. `nccl_communicator_config_path` (a YAML of group name -> NCCL
    options) and `high_priority_stream_groups` (e.g. ['tp', 'ep']) give the named NCCL groups their options
    (megatron/core/nccl_group_options.py)."""
    _check_unsupported(use_sharp=(use_sharp, False),
                       gtp_remat_size=(gtp_remat_size, 1), expert_gtp_remat_size=(expert_gtp_remat_size, 1),
                       sharp_enabled_group=(sharp_enabled_group, None), rank_offset=(rank_offset, 0),
                       )
    if not torch.distributed.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group() first")
    world_size = torch.distributed.get_world_size()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    for name, v in dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp).items():
        if v < 1:
            raise ValueError(f"parallel size {name}={v} must be >= 1")
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) "
                         f"x context ({cp}) model parallel sizes")
    dp = world_size // (tp * pp * cp)
    if world_size % (etp * ep * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by expert tensor ({etp}) x expert "
                         f"model ({ep}) x pipeline ({pp}) parallel sizes")
    edp = world_size // (etp * ep * pp)
    instances = num_distributed_optimizer_instances
    if instances < 1 or (dp * cp) % instances or edp % instances:
        raise ValueError(f"num_distributed_optimizer_instances={instances} must divide the data x context parallel "
                         f"size ({dp * cp}) and the expert data parallel size ({edp})")
    if virtual_pipeline_model_parallel_size is not None and virtual_pipeline_model_parallel_size < 1:
        raise ValueError("virtual_pipeline_model_parallel_size must be >= 1 or None")

    destroy_model_parallel()
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size

    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise ValueError(f"order '{order}' gives different pipeline groups for dense and expert layers; "
                         "put 'pp' last or first in --order")
    timeout = timedelta(minutes=distributed_timeout_minutes)
    gloo_is_default = torch.distributed.get_backend() == "gloo"
    nccl_cfgs = nccl_group_configs(nccl_communicator_config_path, high_priority_stream_groups,
                                   nccl=not gloo_is_default)

    def build(name, rank_groups, backend=None, gloo_name=None):
        rank = torch.distributed.get_rank()
        options = None if backend not in (None, "nccl") else get_nccl_options(megatron_group_name(name), nccl_cfgs)
        for ranks in rank_groups:
            group = torch.distributed.new_group(ranks, timeout=timeout, backend=backend, pg_options=options)
            gloo = None
            if gloo_name and create_gloo_process_groups:
                gloo = group if gloo_is_default else torch.distributed.new_group(ranks, timeout=timeout,
                                                                                 backend="gloo")
            if rank in ranks:
                _GROUPS[name], _RANKS[name] = group, list(ranks)
                if gloo_name:
                    _GROUPS[gloo_name] = gloo

    build("dp", dense.get_ranks("dp"), gloo_name="dp_gloo")
    build("dp_cp", dense.get_ranks("dp-cp"), gloo_name="dp_cp_gloo")
    build("cp", dense.get_ranks("cp"))
    build("mp", dense.get_ranks("tp-pp"))
    build("tp", dense.get_ranks("tp"))
    pp_groups = dense.get_ranks("pp")
    build("pp", pp_groups, backend=pipeline_model_parallel_comm_backend)
    emb_fn = get_embedding_ranks or _default_embedding_ranks
    pos_fn = get_position_embedding_ranks or (lambda ranks: [ranks[0]])
    build("embd", [emb_fn(r) for r in pp_groups])
    build("pos_embd", [pos_fn(r) for r in pp_groups])
    build("tp_dp_cp", dense.get_ranks("tp-dp-cp"))
    build("tp_dp", dense.get_ranks("tp-dp"))
    build("tp_cp", dense.get_ranks("tp-cp"))
    build("etp", expert.get_ranks("tp"))
    build("ep", expert.get_ranks("ep"))
    build("tp_ep", expert.get_ranks("tp-ep"))
    build("tp_ep_pp", expert.get_ranks("tp-ep-pp"))
    build("edp", expert.get_ranks("dp"), gloo_name="edp_gloo")
    if instances > 1:
        _build_optimizer_instance_groups(build, dense.get_ranks("dp-cp"), expert.get_ranks("dp"), instances)
    _build_extra_groups(dense, expert, hierarchical_context_parallel_sizes, hybrid_context_parallel,
                        create_gloo_process_groups, timeout)


def _build_optimizer_instance_groups(build, dp_cp_groups, edp_groups, instances: int) -> None:
    """--num-distributed-optimizer-instances N: each DP x CP group (and each expert-DP group) splits into N
    consecutive parts. The distributed optimizer shards over a part ("intra_dp_cp", "intra_edp"); the ranks at the
    same place in every part ("inter_dist_opt", "inter_edist_opt") hold the same shard and all-reduce it. An
    instance ("intra_dist_opt") is every rank of one part number: one whole replica of the model and its state."""
    def split(groups):
        size = len(groups[0]) // instances
        parts = [g[i * size:(i + 1) * size] for g in groups for i in range(instances)]
        across = [g[j::size] for g in groups for j in range(size)]
        return parts, across, size
    parts, across, size = split(dp_cp_groups)
    build("intra_dp_cp", parts, gloo_name="intra_dp_cp_gloo")
    build("inter_dist_opt", across)
    build("intra_dist_opt", [sorted(r for g in dp_cp_groups for r in g[i * size:(i + 1) * size])
                             for i in range(instances)])
    parts, across, _ = split(edp_groups)
    build("intra_edp", parts, gloo_name="intra_edp_gloo")
    build("inter_edist_opt", across)


def get_num_distributed_optimizer_instances() -> int:
    """How many replicas of the distributed optimizer's state there are (--num-distributed-optimizer-instances)."""
    return _size("inter_dist_opt") if "inter_dist_opt" in _GROUPS else 1


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True, expert: bool = False):
    """The ranks that hold the same distributed-optimizer shard, one per instance (None with one instance);
    ``expert``: the same for the expert parameters' shards."""
    name = "inter_edist_opt" if expert else "inter_dist_opt"
    return _GROUPS.get(name)


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True):
    """Every rank of this rank's distributed-optimizer instance (the whole world with one instance)."""
    return _GROUPS.get("intra_dist_opt") or torch.distributed.group.WORLD


def _partial(name: str, partial: bool) -> str:
    """The name of a DP group, or of its part in this distributed-optimizer instance (``partial``)."""
    intra = {"dp_cp": "intra_dp_cp", "dp_cp_gloo": "intra_dp_cp_gloo", "edp": "intra_edp",
             "edp_gloo": "intra_edp_gloo"}.get(name)
    return intra if partial and intra in _GROUPS else name


def _default_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """First and last pipeline stage hold the (tied) word embeddings."""
    return [pp_ranks[0], pp_ranks[-1]] if len(pp_ranks) > 1 else [pp_ranks[0]]


def model_parallel_is_initialized() -> bool:
    return "tp" in _GROUPS


def destroy_model_parallel() -> None:
    """Forget every group (the process groups themselves die with the default group)."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _clear_groups()
    _OVERRIDES.clear()
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None


# ---- tensor parallel -------------------------------------------------------------------------------

def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _OVERRIDES.get("tp_size", _size("tp"))


def get_tensor_model_parallel_rank() -> int:
    return _OVERRIDES.get("tp_rank", _rank("tp"))


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("tp_size", world_size)


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("tp_rank", rank)


def _set_override(key, value):
    if value is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = value


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return _ranks("tp")[0]


def get_tensor_model_parallel_ranks() -> List[int]:
    return _ranks("tp")


# ---- pipeline parallel -----------------------------------------------------------------------------

def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _OVERRIDES.get("pp_size", _size("pp"))


def get_pipeline_model_parallel_rank() -> int:
    return _OVERRIDES.get("pp_rank", _rank("pp"))


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("pp_size", world_size)


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("pp_rank", rank)


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def _vp_stage(vp_stage: Optional[int]) -> Optional[int]:
    return get_virtual_pipeline_model_parallel_rank() if vp_stage is None else vp_stage


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on PP rank 0 (and, unless ``ignore_virtual``, on its first virtual chunk)."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        if _vp_stage(vp_stage) != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the last PP rank (and, unless ``ignore_virtual``, on its last virtual chunk)."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None:
        if _vp_stage(vp_stage) != vp_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# ---- data / context parallel -----------------------------------------------------------------------

# `with_gtp_remat` (weight-rematerialisation peers) has no effect: that group size is always 1 here.
# `partial_data_parallel`: this distributed-optimizer instance's part of the DP x CP group (the whole group with one
# instance); Megatron defines it with the context-parallel ranks only.
def get_data_parallel_group(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                            partial_data_parallel: bool = False):
    return _group(_partial("dp_cp", partial_data_parallel) if with_context_parallel else "dp")


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    return _group(_partial("dp_cp_gloo", partial_data_parallel) if with_context_parallel else "dp_gloo")


def get_data_parallel_world_size(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                                 partial_data_parallel: bool = False) -> int:
    return _size(_partial("dp_cp", partial_data_parallel) if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                           partial_data_parallel: bool = False) -> int:
    if "dp_rank" in _OVERRIDES:  # set_data_parallel_rank wins for every variant, as in Megatron
        return _OVERRIDES["dp_rank"]
    return _rank(_partial("dp_cp", partial_data_parallel) if with_context_parallel else "dp")


def set_data_parallel_rank(rank: Optional[int]) -> None:
    _set_override("dp_rank", rank)


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _ranks("dp_cp" if with_context_parallel else "dp")[0]


def get_context_parallel_group(check_initialized: bool = True):
    return _group("cp")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> List[int]:
    return _ranks("cp")


# ---- combined groups -------------------------------------------------------------------------------

def get_model_parallel_group(check_initialized: bool = True):
    return _group("mp")


def get_model_parallel_world_size() -> int:
    return _size("mp")


def get_embedding_group(check_initialized: bool = True):
    return _group("embd")


def get_embedding_ranks() -> List[int]:
    return _ranks("embd") if "embd" in _RANKS else []


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True where this rank holds word embeddings that must stay tied (first/last stage)."""
    if not torch.distributed.is_initialized() or "embd" not in _RANKS:
        return True
    if torch.distributed.get_rank() not in _RANKS["embd"]:
        return False
    if ignore_virtual:
        return True
    if is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage):
        return True
    return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def get_position_embedding_group(check_initialized: bool = True):
    return _group("pos_embd")


def is_rank_in_position_embedding_group() -> bool:
    if not torch.distributed.is_initialized() or "pos_embd" not in _RANKS:
        return True
    return torch.distributed.get_rank() in _RANKS["pos_embd"]


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False):
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _group("tp_cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size("tp_cp")


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False):
    if tp_only_amax_red:
        return _group("tp_cp" if with_context_parallel else "tp")
    return get_tensor_and_data_parallel_group(with_context_parallel)


# ---- expert parallel -------------------------------------------------------------------------------

def get_expert_model_parallel_group(check_initialized: bool = True):
    return _group("ep")


def get_expert_model_parallel_world_size() -> int:
    return _OVERRIDES.get("ep_size", _size("ep"))


def get_expert_model_parallel_rank() -> int:
    return _OVERRIDES.get("ep_rank", _rank("ep"))


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    return _group("etp")


def get_expert_tensor_parallel_world_size() -> int:
    return _OVERRIDES.get("etp_size", _size("etp"))


def get_expert_tensor_parallel_rank() -> int:
    return _OVERRIDES.get("etp_rank", _rank("etp"))


# Overrides for tests and single-rank tools, as the TP setters above (None clears).
def set_expert_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("ep_size", world_size)


def set_expert_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("ep_rank", rank)


def set_expert_tensor_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("etp_size", world_size)


def set_expert_tensor_parallel_rank(rank: Optional[int]) -> None:
    _set_override("etp_rank", rank)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    return _group("tp_ep")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size("tp_ep")


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True, with_egtp_remat: bool = False):
    return _group("tp_ep_pp")


def get_expert_data_parallel_group(check_initialized: bool = True, with_gtp_remat: bool = True,
                                   partial_expert_data_parallel: bool = False):
    return _group(_partial("edp", partial_expert_data_parallel))


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False):
    return _group(_partial("edp_gloo", partial_expert_data_parallel))


def get_expert_data_parallel_world_size(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> int:
    return _size(_partial("edp", partial_expert_data_parallel))


def get_expert_data_parallel_rank(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> int:
    return _rank(_partial("edp", partial_expert_data_parallel))


# Megatron-only getters (fixed answers, rank helpers nothing here calls): megatron/core/_compat/parallel_state.py.
_COMPAT = "megatron.core._compat.parallel_state"
__getattr__ = lazy_names(__name__, {
    "is_initialized": _COMPAT, "get_model_parallel_src_rank": _COMPAT,
    "get_expert_model_parallel_src_rank": _COMPAT, "get_all_ranks": _COMPAT, "default_embedding_ranks": _COMPAT,
    "default_position_embedding_ranks": _COMPAT, "get_tensor_and_context_parallel_rank": _COMPAT,
    "get_expert_tensor_and_model_parallel_rank": _COMPAT, "get_global_memory_buffer": _COMPAT,
    "destroy_global_memory_buffer": _COMPAT, "overwrite_nccl_comm_cfgs": _COMPAT,
    "get_gtp_weight_remat_group": _COMPAT,
    "get_gtp_weight_remat_world_size": _COMPAT, "get_gtp_weight_remat_rank": _COMPAT,
    "get_gtp_weight_remat_global_ranks": _COMPAT, "get_expert_gtp_weight_remat_group": _COMPAT,
    "get_expert_gtp_weight_remat_world_size": _COMPAT, "get_expert_gtp_weight_remat_rank": _COMPAT,
    "get_expert_gtp_weight_remat_global_ranks": _COMPAT,
})
