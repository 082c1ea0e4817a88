"""Per-parameter optimizer settings, Megatron 0.19 style: `config_overrides` maps a ParamKey (name glob,
attribute, or predicate) to a ParamGroupOverride (max_lr, min_lr, start_wd, end_wd, wd_mult, or any
per-group key of the inner torch optimizer such as Adam's eps). Params with the same merged override
share a param group."""
from typing import Dict, List, Optional

from megatron.core.optimizer.layer_wise_optimizer import uses_muon
from megatron.core.optimizer.optimizer_config import OptimizerConfig, ParamKey, ParamPredicate, ParamWithNamePredicate
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


def default_no_weight_decay(name: str, param, apply_wd_to_qk_layernorm: bool = False) -> bool:
    """Megatron's standard rule: biases and 1-D params (norm weights) take no weight decay; with
    ``apply_wd_to_qk_layernorm`` (--apply-wd-to-qk-layernorm, Qwen3-Next's rule) the q/k layernorm weights do."""
    if not (name.endswith(".bias") or param.dim() == 1):
        return False
    return not (apply_wd_to_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name))


def standard_config_overrides(config: OptimizerConfig) -> Dict:
    """Megatron's defaults: no weight decay on biases and 1-D params (with apply_wd_to_qk_layernorm, q/k
    layernorm weights keep it), and decoupled_lr / decoupled_min_lr on the embedding and output weights."""
    if config.apply_wd_to_qk_layernorm:
        fn = lambda p, n: default_no_weight_decay(n, p, apply_wd_to_qk_layernorm=True)  # noqa: E731
        no_wd = ParamKey(with_name_predicate=ParamWithNamePredicate(name="s1_not_qkln", fn=fn))
    else:
        no_wd = ParamKey(name="*.bias", predicate=ParamPredicate(name="param_len_1", fn=lambda p: p.dim() == 1))
    overrides = {no_wd: {"wd_mult": 0.0}}
    if config.decoupled_lr is not None:
        decoupled = {"max_lr": config.decoupled_lr}
        if config.decoupled_min_lr is not None:
            decoupled["min_lr"] = config.decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
    return overrides


def _is_vector_like(param, name) -> bool:
    """Embeddings (the output layer too: the model marks both `is_embedding_parameter` under MuP) and 1-D params
    keep the base LR under MuP."""
    if getattr(param, "shared_embedding", False):
        return True
    is_embedding = getattr(param, "is_embedding_parameter", None)
    if is_embedding is not None:
        return bool(is_embedding) or param.dim() <= 1
    return "embedding" in name.lower() or param.dim() <= 1


def mup_config_overrides(config: OptimizerConfig, mup_width_mult: float, optimizer_type: str = "adam") -> Dict:
    """MuP scaling by width multiplier m: Adam-like optimizers divide the LR (and Adam's eps) of hidden
    matrix params by m; SGD multiplies the LR of vector-like params by m. Params on decoupled_lr keep
    it; matrices Muon updates keep Muon's own scaling. Empty for m == 1."""
    if mup_width_mult == 1.0:
        return {}
    kind = optimizer_type.lower()
    decoupled = config.decoupled_lr is not None
    keeps_decoupled = lambda p: decoupled and getattr(p, "is_embedding_or_output_parameter", False)  # noqa: E731
    muon_managed = lambda p: "muon" in kind and uses_muon(p)  # noqa: E731

    def scaled(mult):
        out = {}
        if config.lr is not None:
            out["max_lr"] = config.lr * mult
        if config.min_lr is not None:
            out["min_lr"] = config.min_lr * mult
        return out

    if kind == "sgd":
        lr = scaled(mup_width_mult)
        pred = ParamWithNamePredicate(name="mup_sgd_vector_like_excluding_embedding_output",
                                      fn=lambda p, n: not keeps_decoupled(p) and _is_vector_like(p, n))
        return {ParamKey(with_name_predicate=pred): lr} if lr else {}
    lr = scaled(1.0 / mup_width_mult)
    eps = {"eps": config.adam_eps / mup_width_mult} if "adam" in kind and config.adam_eps is not None else {}
    hidden = lambda p, n: not _is_vector_like(p, n) and not muon_managed(p)  # noqa: E731
    if not decoupled:
        combined = {**lr, **eps}
        pred = ParamWithNamePredicate(name="mup_hidden_and_output", fn=hidden)
        return {ParamKey(with_name_predicate=pred): combined} if combined else {}
    out = {}
    if lr:
        pred = ParamWithNamePredicate(name="mup_hidden_only_excluding_embedding_output",
                                      fn=lambda p, n: not keeps_decoupled(p) and hidden(p, n))
        out[ParamKey(with_name_predicate=pred)] = lr
    if eps:
        out[ParamKey(with_name_predicate=ParamWithNamePredicate(name="mup_hidden_only_for_adam_eps", fn=hidden))] = eps
    return out
