"""ProcessGroupCollection: the process groups a module needs, passed explicitly instead of read from
parallel_state's globals. Groups that are off (hierarchical CP without its sizes) or never built here (weight
rematerialisation, distributed-optimizer instances) are None, as in Megatron when they are off."""
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state as ps
from megatron.core.utils import lazy_names

# Megatron's metaclass, which no class here uses, resolved on first use.
__getattr__ = lazy_names(__name__, {"ProcessGroupHelperMeta": "megatron.core._compat.process_groups_config"})

_PG = torch.distributed.ProcessGroup


@dataclass
class ProcessGroupCollection:
    """Named process groups (tp, pp, cp, dp, dp_cp, ep, ...); unset names read as None."""

    tp: _PG = field(init=False)
    pp: _PG = field(init=False)
    mp: _PG = field(init=False)
    embd: _PG = field(init=False)
    pos_embd: _PG = field(init=False)
    cp: _PG = field(init=False)
    tp_cp: _PG = field(init=False)
    hcp: List[_PG] = field(init=False)
    ep: _PG = field(init=False)
    expt_tp: _PG = field(init=False)
    tp_ep: _PG = field(init=False)
    tp_ep_pp: _PG = field(init=False)
    tp_ep_pp_with_egtp_remat: _PG = field(init=False)
    tp_dp_cp: _PG = field(init=False)
    dp: _PG = field(init=False)
    dp_cp: _PG = field(init=False)
    dp_cp_gtp_remat: _PG = field(init=False)
    dp_cp_ag: _PG = field(init=False)
    gtp_remat: _PG = field(init=False)
    expt_gtp_remat: _PG = field(init=False)
    expt_dp: _PG = field(init=False)
    expt_dp_gtp_remat: _PG = field(init=False)
    expt_dp_ag: _PG = field(init=False)
    intra_dp_cp: _PG = field(init=False)
    intra_expt_dp: _PG = field(init=False)
    inter_dist_opt: _PG = field(init=False)
    intra_dist_opt: _PG = field(init=False)

    def __init__(self, **kwargs):
        known = {f.name for f in fields(self)}
        for key, value in kwargs.items():
            if key not in known:
                raise ValueError(f"ProcessGroupCollection: unknown process group '{key}'")
            setattr(self, key, value)

    def __getattr__(self, name: str):
        if name in {f.name for f in fields(self.__class__)}:
            return None
        raise AttributeError(f"'ProcessGroupCollection' object has no attribute '{name}'")

    def __repr__(self):
        sizes = [f"{f.name}({_size(vars(self)[f.name])})" for f in fields(self)
                 if vars(self).get(f.name) is not None]
        return f"ProcessGroupCollection({', '.join(sizes) or 'empty'})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Optional[List[str]] = None):
        """A collection holding parallel_state's groups (all of them, or those in `required_pgs`)."""
        getters = _mpu_getters()
        names = list(getters) if required_pgs is None else required_pgs
        bad = [n for n in names if n not in getters]
        if bad:
            raise ValueError(f"Invalid process groups requested: {bad}")
        return cls(**{n: getters[n]() for n in names})

    @staticmethod
    def is_gtp_remat_active(process_group_dict: Dict) -> bool:
        """Weight rematerialisation groups are never built here."""
        return any(g is not None and _size(g) > 1 for k, g in process_group_dict.items()
                   if k in ("gtp_remat", "expt_gtp_remat"))


def _size(group):
    return [g.size() for g in group] if isinstance(group, list) else group.size()


def _none():
    return None


def _mpu_getters():
    """parallel_state getter for each field; groups this package does not build map to None."""
    return {
        "tp": partial(ps.get_tensor_model_parallel_group, check_initialized=False),
        "pp": partial(ps.get_pipeline_model_parallel_group, check_initialized=False),
        "mp": partial(ps.get_model_parallel_group, check_initialized=False),
        "embd": partial(ps.get_embedding_group, check_initialized=False),
        "pos_embd": partial(ps.get_position_embedding_group, check_initialized=False),
        "cp": partial(ps.get_context_parallel_group, check_initialized=False),
        "tp_cp": ps.get_tensor_and_context_parallel_group,
        "hcp": partial(ps.get_hierarchical_context_parallel_groups, check_initialized=False),
        "ep": partial(ps.get_expert_model_parallel_group, check_initialized=False),
        "expt_tp": partial(ps.get_expert_tensor_parallel_group, check_initialized=False),
        "tp_ep": partial(ps.get_expert_tensor_and_model_parallel_group, check_initialized=False),
        "tp_ep_pp": partial(ps.get_expert_tensor_model_pipeline_parallel_group, check_initialized=False),
        "tp_ep_pp_with_egtp_remat": partial(ps.get_expert_tensor_model_pipeline_parallel_group,
                                            check_initialized=False),
        "tp_dp_cp": partial(ps.get_tensor_and_data_parallel_group, with_context_parallel=True),
        "dp": ps.get_data_parallel_group,
        "dp_cp": partial(ps.get_data_parallel_group, with_context_parallel=True),
        "dp_cp_gtp_remat": partial(ps.get_data_parallel_group, with_context_parallel=True),
        "dp_cp_ag": _none,
        "gtp_remat": _none,
        "expt_gtp_remat": _none,
        "expt_dp": partial(ps.get_expert_data_parallel_group, check_initialized=False),
        "expt_dp_gtp_remat": partial(ps.get_expert_data_parallel_group, check_initialized=False),
        "expt_dp_ag": _none,
        "intra_dp_cp": partial(ps.get_data_parallel_group, with_context_parallel=True,
                               partial_data_parallel=True),
        "intra_expt_dp": partial(ps.get_expert_data_parallel_group, check_initialized=False,
                                 partial_expert_data_parallel=True),
        "inter_dist_opt": partial(ps.get_inter_distributed_optimizer_instance_group, check_initialized=False),
        "intra_dist_opt": partial(ps.get_intra_distributed_optimizer_instance_group, check_initialized=False),
    }


def require_default_process_groups(pg_collection, owner: str) -> None:
    """For the modules that still read parallel_state's groups (T5, BERT, the FSDP2 engine): a collection
    holding those same groups (e.g. ProcessGroupCollection.use_mpu_process_groups()) gives the same result
    and is accepted; one with other groups is refused in one line."""
    if pg_collection is None:
        return
    getters = _mpu_getters()
    for name, group in vars(pg_collection).items():
        if name in getters and group is not None and group is not getters[name]():
            raise NotImplementedError(f"{owner}(pg_collection=...): its '{name}' group differs from "
                                      "parallel_state's; only parallel_state's groups are supported")



# ---- explicit groups, parallel_state's by default ----------------------------------------------------
# Modules take a `pg_collection` and fall back to parallel_state's groups when it is None, as
# ColumnParallelLinear(tp_group=) does. A group a module communicates over must be set in an explicit
# collection (a one-rank group where that axis is not split): everywhere below, a None group stands for
# parallel_state's (torch's collectives read it as the whole world), so leaving it out would silently
# leave the explicit groups.

def group_size(group) -> int:
    """Ranks in ``group``; None (no group) counts as one."""
    return 1 if group is None else group.size()


def group_rank(group) -> int:
    """This rank's index in ``group``; 0 without a group."""
    return 0 if group is None else group.rank()


def _registry_axes():
    """Collection field -> parallel_state's (world size, rank) getters, which honour its test overrides
    (set_tensor_model_parallel_world_size ...)."""
    dp_cp = dict(with_context_parallel=True)
    return {
        "tp": (ps.get_tensor_model_parallel_world_size, ps.get_tensor_model_parallel_rank),
        "cp": (ps.get_context_parallel_world_size, ps.get_context_parallel_rank),
        "pp": (ps.get_pipeline_model_parallel_world_size, ps.get_pipeline_model_parallel_rank),
        "ep": (ps.get_expert_model_parallel_world_size, ps.get_expert_model_parallel_rank),
        "expt_tp": (ps.get_expert_tensor_parallel_world_size, ps.get_expert_tensor_parallel_rank),
        "expt_dp": (ps.get_expert_data_parallel_world_size, ps.get_expert_data_parallel_rank),
        "dp": (ps.get_data_parallel_world_size, ps.get_data_parallel_rank),
        "dp_cp": (partial(ps.get_data_parallel_world_size, **dp_cp), partial(ps.get_data_parallel_rank, **dp_cp)),
    }


def get_pg(pg_collection, name: str, owner: str = "pg_collection"):
    """The ``name`` group of ``pg_collection`` (which must hold it), or parallel_state's when the
    collection is None."""
    if pg_collection is None:
        return _mpu_getters()[name]()
    group = getattr(pg_collection, name)
    if group is None:
        raise ValueError(f"{owner}: the explicit pg_collection has no '{name}' group, which it communicates "
                         "over; set it (a one-rank group if that axis is not split)")
    return group


def get_pg_size(pg_collection, name: str, owner: str = "pg_collection") -> int:
    """Ranks along axis ``name``: the collection's group, or parallel_state's size (overrides included)."""
    if pg_collection is None:
        return _registry_axes()[name][0]()
    return get_pg(pg_collection, name, owner).size()


def get_pg_rank(pg_collection, name: str, owner: str = "pg_collection") -> int:
    """This rank's index along axis ``name``: in the collection's group, or parallel_state's rank."""
    if pg_collection is None:
        return _registry_axes()[name][1]()
    return get_pg(pg_collection, name, owner).rank()


_CONFIG_SIZES = (("tp", "tensor_model_parallel_size"), ("cp", "context_parallel_size"),
                 ("pp", "pipeline_model_parallel_size"))
_EXPERT_CONFIG_SIZES = (("ep", "expert_model_parallel_size"), ("expt_tp", "expert_tensor_parallel_size"))


def check_collection_sizes(pg_collection, config, owner: str) -> None:
    """An explicit collection must split the model as ``config`` says: each group (tp, cp, pp; ep and
    expt_tp with experts) is set and has the config's parallel size. One line naming the group otherwise."""
    if pg_collection is None:
        return
    pairs = _CONFIG_SIZES + (_EXPERT_CONFIG_SIZES if getattr(config, "num_moe_experts", None) else ())
    for name, field_name in pairs:
        want = getattr(config, field_name, None) or 1
        got = get_pg_size(pg_collection, name, owner)
        if got != want:
            raise ValueError(f"{owner}: the '{name}' group of pg_collection has {got} rank(s) but "
                             f"config.{field_name} is {want}")
