"""Optimizer state as Megatron-LM's training checkpoints hold it, read into and written from ours.

Megatron's distributed optimizer saved with ``--dist-ckpt-optim-fully-reshardable`` (sharding type
``fully_reshardable``) keeps one tensor per model param and state: ``optimizer.state.<name>.<model key>``, with
``param`` for the fp32 main param (ours: ``fp32_param``), ``exp_avg`` and ``exp_avg_sq``; its non-tensor part is
``{'optimizer': {'param_groups': [...]}, 'param_state_sharding_type': ...}`` with each group's hyper-parameters and
Adam ``step`` (no param lists). Its non-distributed optimizer uses our state names (``fp32_param``) and keeps the
step as ``common_step`` of the torch optimizer's state dict. Ours is the same per-param layout with the groups
at the top (optimizer_state.py), so the conversion renames one state and moves the groups, matched by the group identity
Megatron matches them by (weight-decay and LR multipliers, expert, decoupled LR).

An MoE model's Megatron optimizer is a ChainedOptimizer of a dense and an expert optimizer, saved as ``{0: ...,
1: ...}`` with unprefixed tensor keys; ours is one optimizer, so the groups of both are read as one list.
`to_megatron` is the way back: our optimizer's sharded state dict as Megatron's distributed optimizer writes it
with that flag (chained for an MoE model), so Megatron-LM resumes from it.

Megatron's ``dp_reshardable`` sharding type (its default without that flag) stores the distributed optimizer's
flat gradient-buffer shards instead: megatron_dp_reshardable.py rebuilds Megatron's buffer layout to read them.
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


def _parts(common_optimizer) -> List[Dict]:
    """Megatron's optimizer states in a checkpoint's 'optimizer' entry: the one, or a ChainedOptimizer's (an MoE
    model's dense and expert optimizers, ``{0: ..., 1: ...}``; their tensor keys carry no prefix)."""
    if not isinstance(common_optimizer, dict):
        return []
    if common_optimizer and all(isinstance(k, int) for k in common_optimizer):
        return [common_optimizer[k] for k in sorted(common_optimizer)]
    return [common_optimizer]


def is_megatron_optimizer_state(common_optimizer: Dict) -> bool:
    """True when a checkpoint's non-tensor optimizer state is Megatron-LM's (groups under 'optimizer')."""
    parts = _parts(common_optimizer)
    return bool(parts) and all(
        isinstance(p, dict) and isinstance(p.get("optimizer"), dict) and "param_groups" in p["optimizer"]
        and "param_groups" not in p for p in parts)


def sharding_type(common_optimizer: Dict):
    """The distributed optimizer's sharding type of a Megatron optimizer state (None: its non-distributed one)."""
    kinds = {p.get("param_state_sharding_type") for p in _parts(common_optimizer) if isinstance(p, dict)}
    return kinds.pop() if len(kinds) == 1 else sorted(map(str, kinds))


def check_sharding_type(common_optimizer: Dict, checkpoint_dir: str) -> None:
    """Raise one line for a Megatron optimizer state this loader cannot read."""
    kind = sharding_type(common_optimizer)
    if kind is not None and kind not in (SHARDING_TYPE, "dp_reshardable"):
        raise ValueError(f"checkpoint {checkpoint_dir}: Megatron-LM's distributed optimizer state is in its "
                         f"'{kind}' format, which is not read here; resume with --no-load-optim, or re-save it "
                         f"from Megatron-LM with --dist-ckpt-optim-fully-reshardable")


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
    saved = []
    for part in _parts(common_optimizer):
        groups = part["optimizer"]["param_groups"]
        # Megatron's non-distributed optimizer keeps Adam's step once, as 'common_step' of its torch state dict.
        common_step = (part["optimizer"].get("state") or {}).get("common_step")
        if common_step is not None:
            groups = [{**g, "step": float(common_step)} for g in groups if "step" not in g] or groups
        saved += [{k: v for k, v in g.items() if k != "params"} for g in groups]
    by_identity = {tuple(g.get(k) for k in GROUP_IDENTITY): g for g in saved}
    out = []
    for group in our_groups:
        identity = tuple(group.get(k) for k in GROUP_IDENTITY)
        dense_twin = identity[:2] + (False,) + identity[3:]
        if identity not in by_identity and group.get("is_expert_parallel") and dense_twin in by_identity:
            identity = dense_twin  # Megatron's local spec leaves expert params in the dense groups
        if identity not in by_identity:
            wanted = dict(zip(GROUP_IDENTITY, identity))
            raise ValueError(f"the checkpoint's optimizer has no param group with {wanted} "
                             f"(it has {[dict(zip(GROUP_IDENTITY, i)) for i in by_identity]}); resume with "
                             f"--no-load-optim or the checkpoint's weight-decay / LR-multiplier settings")
        out.append(by_identity[identity])
    return out


def to_our_state(loaded_optimizer: Dict, our_groups: List[Dict]) -> Dict:
    """A loaded Megatron optimizer state (tensors filled in under our request's structure) in our format."""
    chained = {k: v for k, v in loaded_optimizer.items() if isinstance(k, int)}
    parts = _parts(chained) if chained else [loaded_optimizer]
    out = {k: v for k, v in loaded_optimizer.items() if k != "optimizer" and not isinstance(k, int)}
    out["param_groups"] = groups_to_ours({i: p for i, p in enumerate(parts)}, our_groups)
    if "grad_scaler" in parts[0]:
        out["grad_scaler"] = parts[0]["grad_scaler"]
    out["param_state_sharding_type"] = SHARDING_TYPE
    return out


# Adam's per-group settings as Megatron's optimizers hold them (torch AdamW on CPU, TE/Apex FusedAdam on GPU):
# a group loaded into them replaces theirs whole, so a key they read must be in the saved group.
# ``decoupled_weight_decay``: Megatron's "adam" is AdamW.
_ADAM_GROUP_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                        "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                        "bias_correction": True}
# megatron/training/checkpointing.py's _build_sharded_state_dict_metadata for a fully_reshardable save: how
# Megatron-LM's loader builds its optimizer's sharded state dict to read the checkpoint.
CONTENT_METADATA = {"distrib_optim_sharding_type": SHARDING_TYPE,
                    "distrib_optim_fully_reshardable_mem_efficient": False, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}


def to_megatron_common(our_common: Dict) -> Dict:
    """Our optimizer state's non-tensor part as Megatron's distributed optimizer saves it (fully_reshardable):
    the groups under 'optimizer' without params, each with Megatron's LR bounds and one Adam step for all (its
    loader asserts they agree; a group with no params on this rank counts 0 steps here)."""
    out = {k: v for k, v in our_common.items() if k not in ("param_groups", "param_state")}
    step = max((g.get("step", 0.0) for g in our_common["param_groups"]), default=0.0)
    groups = []
    for g in our_common["param_groups"]:
        g = dict(g, step=step)
        g.setdefault("max_lr", g.get("lr"))
        g.setdefault("min_lr", 0.0)
        g.setdefault("default_config", not g.get("is_decoupled_lr", False) and g.get("lr_mult", 1.0) == 1.0)
        if "betas" in g:
            g = {**_ADAM_GROUP_DEFAULTS, **g}
        groups.append(g)
    out["optimizer"] = {"param_groups": groups}
    out["param_state_sharding_type"] = SHARDING_TYPE
    return out


def _with_main_params(param_state: Dict, model_sharded_sd: Dict) -> Dict:
    """``param_state`` with a ``param`` entry for each param that has none: Megatron's distributed optimizer always
    keeps an fp32 main param and its loader reads it, while ours (fp32 training) uses the model param itself."""
    model = {v.key: v for _, v in dict_utils.iter_leaves(model_sharded_sd)
             if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    out = {}
    for key, entry in param_state.items():
        if isinstance(entry, dict) and entry and "fp32_param" not in entry:
            if key not in model:
                raise ValueError(f"optimizer state of '{key}' has no model tensor of that key to save as its "
                                 "main param")
            entry = {**entry, "param": replace(model[key], key=f"{_PREFIX}param.{key}")}
        out[key] = entry
    return out


def to_megatron(our_sharded: Dict, expert_optimizer: bool = True, model_sharded_sd: Dict = None) -> Dict:
    """Our optimizer's sharded state dict (``optimizer.sharded_state_dict``; a ChainedOptimizer's ``{index:
    ...}``) as Megatron's distributed optimizer's, fully_reshardable: what Megatron-LM's loader asks for.
    Megatron gives expert params (``allreduce=False``: its Transformer Engine spec marks them so) their own
    optimizer, chained after the dense one; with ``expert_optimizer`` (a model with experts built from that
    spec) the state is that chained pair, each with its own groups, else one optimizer whose groups hold the
    expert params too (its local spec). The tensors' keys name their params, so where they sit does not matter.
    ``model_sharded_sd`` (the model's sharded state dict) supplies the main params an fp32 run keeps none of."""
    if "param_groups" not in our_sharded:  # a ChainedOptimizer: one state with all groups
        parts = [our_sharded[i] for i in sorted(our_sharded)]
        our_sharded = {**parts[0], "param_groups": [g for p in parts for g in p["param_groups"]],
                       "param_state": {k: v for p in parts for k, v in p["param_state"].items()}}
    step = max((g.get("step", 0.0) for g in our_sharded["param_groups"]), default=0.0)
    groups = [dict(g, step=step) for g in our_sharded["param_groups"]]
    dense = [g for g in groups if not g.get("is_expert_parallel")]
    expert = [g for g in groups if g.get("is_expert_parallel")]
    state = rename_state_keys(our_sharded["param_state"])
    if model_sharded_sd is not None:
        state = _with_main_params(state, model_sharded_sd)
    if not expert_optimizer:  # expert groups folded into their dense twins (same hyper-parameters)
        identities = {tuple(g.get(k) for k in GROUP_IDENTITY) for g in dense}
        for g in expert:
            g = dict(g, is_expert_parallel=False)
            if tuple(g.get(k) for k in GROUP_IDENTITY) not in identities:
                dense.append(g)
                identities.add(tuple(g.get(k) for k in GROUP_IDENTITY))
        expert = []
    if not expert:
        return {**to_megatron_common({**our_sharded, "param_groups": dense}), "param_state": state}
    chained = {i: to_megatron_common({**our_sharded, "param_groups": part}) for i, part in enumerate((dense, expert))}
    chained[0]["param_state"] = state
    return chained
