"""Megatron Core's ``megatron.core.optimizer`` names that this project's own code does not call: the
builders of Megatron's standard and MuP ``config_overrides`` (``get_megatron_optimizer`` applies any
overrides it is given; without them it uses the same standard rules directly) and the flag of Megatron's
optional emerging-optimizers package (Muon is built in here: megatron/core/optimizer/muon.py).
Reached from ``megatron.core.optimizer`` through its lazy alias table.
"""
from typing import Dict

from megatron.core.optimizer import default_no_weight_decay
from megatron.core.optimizer.optimizer_config import OptimizerConfig, ParamKey, ParamPredicate, ParamWithNamePredicate

# Megatron's flag for its optional emerging-optimizers package (SOAP, Lion...): not installed; Muon is built in.
HAVE_EMERGING_OPTIMIZERS = False


def get_standard_config_overrides(config: OptimizerConfig) -> Dict:
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
    """Embeddings and 1-D params keep the base LR under MuP."""
    if getattr(param, "shared_embedding", False):
        return True
    is_embedding = getattr(param, "is_embedding_parameter", None)
    if is_embedding is not None:
        return bool(is_embedding) or param.dim() <= 1
    return "embedding" in name.lower() or param.dim() <= 1


def get_mup_config_overrides(config: OptimizerConfig, mup_width_mult: float, optimizer_type: str = "adam") -> Dict:
    """MuP scaling by width multiplier m: Adam-like optimizers divide the LR (and Adam's eps) of hidden
    matrix params by m; SGD multiplies the LR of vector-like params by m. Params on decoupled_lr keep
    it. Empty for m == 1."""
    if mup_width_mult == 1.0:
        return {}
    kind = optimizer_type.lower()
    decoupled = config.decoupled_lr is not None
    keeps_decoupled = lambda p: decoupled and getattr(p, "is_embedding_or_output_parameter", False)  # noqa: E731

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
    hidden = lambda p, n: not _is_vector_like(p, n)  # noqa: E731
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
