"""Per-parameter optimizer settings, Megatron 0.19 style: `config_overrides` maps a ParamKey (name glob,
attribute, or predicate) to a ParamGroupOverride (max_lr, min_lr, start_wd, end_wd, wd_mult, or any
per-group key of the inner torch optimizer such as Adam's eps). Params with the same merged override
share a param group."""
from typing import Dict, List, Optional

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer_param_scheduler import combine_param_group_overrides, param_group_override_to_tuple

# Override keys that must agree with the config: one optimizer class and one step layout for all groups.
_CONSISTENT_FIELDS = ("overlap_param_gather_with_optimizer_step", "optimizer", "optimizer_cpu_offload")










def check_config_overrides_consistency(config: OptimizerConfig, config_overrides: Optional[Dict]) -> bool:
    """Overrides may not change the optimizer class or its step layout."""
    for override in (config_overrides or {}).values():
        for field_name in _CONSISTENT_FIELDS:
            if field_name in override and override[field_name] != getattr(config, field_name, None):
                raise ValueError(f"Field {field_name} should not be overriden in a config override.")
    return True


def trainable_named_parameters(model_chunks):
    """(name, param) of every param that requires grad, each once (tied weights appear in two chunks)."""
    seen = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                yield name, param


def param_groups_from_overrides(model_chunks, config: OptimizerConfig, config_overrides: Dict) -> List[Dict]:
    """One param group per (merged override, expert or not), the plain group first; each group starts
    from wd_mult = lr_mult = 1, max_lr = config.lr, min_lr = config.min_lr and takes its override on top.
    `default_config` marks the groups on the default LR schedule (the one the log line shows)."""
    groups: Dict = {}
    for name, param in trainable_named_parameters(model_chunks):
        matched = [o for key, o in config_overrides.items() if key.matches(param, name)]
        override = combine_param_group_overrides(matched) if matched else None
        key = (param_group_override_to_tuple(override), not getattr(param, "allreduce", True))
        groups.setdefault(key, []).append(param)
    out = []
    for (override_tuple, expert) in sorted(groups, key=lambda k: (k[0] is not None, k[0] or (), k[1])):
        override = dict(override_tuple or ())
        if "params" in override:
            raise ValueError("config_overrides: 'params' is not an override key")
        group = {"params": groups[(override_tuple, expert)], "is_expert_parallel": expert,
                 "default_config": not any("lr" in k for k in override), "wd_mult": 1.0, "lr_mult": 1.0,
                 "is_decoupled_lr": False, "max_lr": config.lr, "min_lr": config.min_lr, **override}
        group["min_lr"] = 0.0 if group["min_lr"] is None else group["min_lr"]
        group["lr"] = (group["max_lr"] or 0.0) * group["lr_mult"]
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
        out.append(group)
    return out
