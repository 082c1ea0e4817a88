"""Optimizer state as Megatron-LM's training checkpoints hold it, read into and written from ours.

Megatron's distributed optimizer saved with ``--dist-ckpt-optim-fully-reshardable`` (sharding type
``fully_reshardable``) keeps one tensor per model param and state: ``optimizer.state.<name>.<model key>``, with
``param`` for the fp32 main param (ours: ``fp32_param``), ``exp_avg`` and ``exp_avg_sq``; its non-tensor part is
``{'optimizer': {'param_groups': [...]}, 'param_state_sharding_type': ...}`` with each group's hyper-parameters and
Adam ``step`` (no param lists). Its non-distributed optimizer uses our state names (``fp32_param``) and keeps the
step as ``common_step`` of the torch optimizer's state dict. Ours is the same per-param layout with the groups
at the top (optimizer_state.py), so the conversion renames one state and moves the groups, matched by the group identity
Megatron matches them by (weight-decay and LR multipliers, expert, decoupled LR).

Megatron's ``dp_reshardable`` sharding type (its default without that flag) stores the distributed optimizer's
flat gradient-buffer shards instead, which only Megatron's own buffer layout can read; such a checkpoint is
refused with one line (load it with ``--no-load-optim``, or re-save it from Megatron with the flag).
"""
from dataclasses import replace
from typing import Dict, List

from megatron.core.dist_checkpointing import dict_utils
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from .optimizer_state import SHARDING_TYPE

# Group fields that identify a param group across frameworks (Megatron's param_group_identifier_keys, the ones
# both sides have).
GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
# Our state name -> Megatron's, where they differ.
STATE_NAMES = {"fp32_param": "param"}
_PREFIX = "optimizer.state."


def is_megatron_optimizer_state(common_optimizer: Dict) -> bool:
    """True when a checkpoint's non-tensor optimizer state is Megatron-LM's (groups under 'optimizer')."""
    return (isinstance(common_optimizer, dict) and isinstance(common_optimizer.get("optimizer"), dict)
            and "param_groups" in common_optimizer["optimizer"] and "param_groups" not in common_optimizer)


def check_sharding_type(common_optimizer: Dict, checkpoint_dir: str) -> None:
    """Raise one line for a Megatron optimizer state this loader cannot read."""
    kind = common_optimizer.get("param_state_sharding_type")
    if kind is not None and kind != SHARDING_TYPE:
        raise ValueError(f"checkpoint {checkpoint_dir}: Megatron-LM's distributed optimizer state is in its "
                         f"'{kind}' format, which only Megatron's own gradient-buffer layout reads; resume with "
                         f"--no-load-optim, or re-save it from Megatron-LM with --dist-ckpt-optim-fully-reshardable")


def _rename(key: str, names: Dict[str, str]) -> str:
    if not key.startswith(_PREFIX):
        return key
    name, _, rest = key[len(_PREFIX):].partition(".")
    return _PREFIX + names.get(name, name) + "." + rest


def rename_state_keys(optimizer_sharded_sd: Dict, to_megatron: bool = True) -> Dict:
    """``optimizer_sharded_sd`` (ours) with its tensors' keys in the state names of Megatron's distributed
    optimizer (or back)."""
    names = STATE_NAMES if to_megatron else {v: k for k, v in STATE_NAMES.items()}
    return dict_utils.map_leaves(
        lambda v: replace(v, key=_rename(v.key, names)) if isinstance(v, (ShardedTensor, ShardedTensorFactory))
        else v, optimizer_sharded_sd)


def groups_to_ours(common_optimizer: Dict, our_groups: List[Dict]) -> List[Dict]:
    """Megatron's saved param groups reordered as ours, matched by GROUP_IDENTITY; one line when one is missing."""
    saved = common_optimizer["optimizer"]["param_groups"]
    # Megatron's non-distributed optimizer keeps Adam's step once, as 'common_step' of its torch state dict.
    common_step = (common_optimizer["optimizer"].get("state") or {}).get("common_step")
    if common_step is not None:
        saved = [{**g, "step": float(common_step)} for g in saved if "step" not in g] or saved
    saved = [{k: v for k, v in g.items() if k != "params"} for g in saved]
    by_identity = {tuple(g.get(k) for k in GROUP_IDENTITY): g for g in saved}
    out = []
    for group in our_groups:
        identity = tuple(group.get(k) for k in GROUP_IDENTITY)
        if identity not in by_identity:
            wanted = dict(zip(GROUP_IDENTITY, identity))
            raise ValueError(f"the checkpoint's optimizer has no param group with {wanted} "
                             f"(it has {[dict(zip(GROUP_IDENTITY, i)) for i in by_identity]}); resume with "
                             f"--no-load-optim or the checkpoint's weight-decay / LR-multiplier settings")
        out.append(by_identity[identity])
    return out


def to_our_state(loaded_optimizer: Dict, our_groups: List[Dict]) -> Dict:
    """A loaded Megatron optimizer state (tensors filled in under our request's structure) in our format."""
    out = {k: v for k, v in loaded_optimizer.items() if k != "optimizer"}
    out["param_groups"] = groups_to_ours(loaded_optimizer, our_groups)
    out["param_state_sharding_type"] = SHARDING_TYPE
    return out


def to_megatron_common(our_common: Dict) -> Dict:
    """Our optimizer state's non-tensor part as Megatron's distributed optimizer saves it (fully_reshardable)."""
    out = {k: v for k, v in our_common.items() if k not in ("param_groups", "param_state")}
    groups = []
    for g in our_common["param_groups"]:
        g = dict(g)
        g.setdefault("max_lr", g.get("lr"))
        groups.append(g)
    out["optimizer"] = {"param_groups": groups}
    out["param_state_sharding_type"] = SHARDING_TYPE
    return out
