"""Megatron's optimizer names, one process: ParamKey selection, the optimizer config subclasses and
override tuples, config overrides (standard, MuP, per-group weight decay), clipping and zero counting by
parameters, and init_state_fn."""
import pytest
import torch


def test_param_key_selects_by_name_attr_and_predicates():
    from megatron.core.optimizer import ParamKey, ParamPredicate, ParamWithNamePredicate
    p = torch.nn.Parameter(torch.zeros(3))
    p.is_embedding_or_output_parameter = True
    assert ParamKey(name="*.bias").matches(p, "decoder.layers.0.mlp.linear_fc1.bias")
    assert not ParamKey(name=("*.weight",)).matches(p, "decoder.layers.0.mlp.linear_fc1.bias")
    assert ParamKey(attr="is_embedding_or_output_parameter").matches(p, "x")
    assert not ParamKey(attr="sequence_parallel").matches(p, "x")
    assert ParamKey(predicate=ParamPredicate("1d", lambda q: q.ndim == 1)).matches(p, "x")
    assert ParamKey(with_name_predicate=ParamWithNamePredicate("n", lambda q, n: n.endswith("norm"))).matches(
        p, "a.norm")
    assert not ParamKey().matches(p, "anything")  # no criterion: selects nothing
    assert hash(ParamKey(name=("a", "b"))) == hash(ParamKey(name=("a", "b")))  # usable as a dict key


def test_optimizer_config_subclasses_and_override_tuple():
    from megatron.core.optimizer import AdamOptimizerConfig, SGDOptimizerConfig
    from megatron.core.optimizer_param_scheduler import param_group_override_to_tuple
    assert AdamOptimizerConfig(lr=1e-3).optimizer == "adam" and SGDOptimizerConfig(lr=1e-3).optimizer == "sgd"
    assert param_group_override_to_tuple(None) is None
    assert param_group_override_to_tuple({"wd_mult": 0.0, "max_lr": 1.0}) == (("max_lr", 1.0), ("wd_mult", 0.0))


def test_optimizer_init_state_fn_creates_missing_state():
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig
    model = torch.nn.Linear(3, 2)

    def init_state_fn(opt, config):  # Megatron's form: called with the torch optimizer and the config
        w = model.weight
        opt.state[w].update(step=torch.tensor(0.0), exp_avg=torch.full_like(w, config.lr),
                            exp_avg_sq=torch.zeros_like(w))

    inner = torch.optim.AdamW(model.parameters(), lr=0.5)
    opt = FP32Optimizer(inner, OptimizerConfig(lr=0.5), init_state_fn)
    state = opt.param_state_for_save()
    assert torch.equal(state[model.weight]["exp_avg"], torch.full((2, 3), 0.5))
    assert torch.equal(state[model.bias]["exp_avg"], torch.zeros(2))  # left without state: the default


def test_optimizer_config_overrides():
    """get_standard_config_overrides reproduces the default groups; MuP overrides scale hidden LR and
    Adam eps; per-group start_wd/end_wd reach the scheduler; the canonical LR is the default group's."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        ParamKey,
        check_config_overrides_consistency,
        get_megatron_optimizer,
        get_mup_config_overrides,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer_param_scheduler import (
        OptimizerParamScheduler,
        combine_param_group_overrides,
        get_canonical_lr_for_logging,
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    config = OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1)

    def groups(opt):
        return sorted((tuple(sorted(p.shape for p in g["params"])), g["wd_mult"], g["max_lr"])
                      for g in opt.param_groups if g["params"])

    default = get_megatron_optimizer(config, [model])
    standard = get_megatron_optimizer(config, [model], config_overrides=get_standard_config_overrides(config))
    assert groups(default) == groups(standard)
    mup = get_megatron_optimizer(config, [model], config_overrides=get_mup_config_overrides(config, 4.0))
    hidden = [g for g in mup.param_groups if any(p.dim() == 2 for p in g["params"])][0]
    assert hidden["max_lr"] == pytest.approx(config.lr / 4) and hidden["eps"] == pytest.approx(config.adam_eps / 4)
    assert not hidden["default_config"]
    wd = {ParamKey(name="2.weight"): {"start_wd": 0.0, "end_wd": 0.2}}
    opt = get_megatron_optimizer(config, [model], config_overrides=wd)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="linear", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="linear")
    sched.step(5)
    special = [g for g in opt.param_groups if g.get("end_wd") == 0.2][0]
    assert special["weight_decay"] == pytest.approx(0.1)  # halfway from 0 to 0.2
    assert get_canonical_lr_for_logging(opt.param_groups) == pytest.approx(sched.get_lr({}))
    with pytest.raises(ValueError, match="Conflicting"):
        combine_param_group_overrides([{"max_lr": 1.0}, {"max_lr": 2.0}])
    with pytest.raises(ValueError, match="optimizer"):
        check_config_overrides_consistency(config, {ParamKey(name="*"): {"optimizer": "sgd"}})


def test_clip_and_count_zeros_by_parameters():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32
    from megatron.core.optimizer.optimizer import ProxyDict
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.0, 0.0])
    assert count_zeros_fp32([a, b], None) == 3
    clip_grad_by_total_norm_fp32([a, b], max_norm=1.0, total_norm=5.0)
    torch.testing.assert_close(a.grad, torch.tensor([3.0, 0.0, 4.0]) / (5.0 + 1e-6))
    b.decoupled_grad = torch.tensor([2.0, 2.0])
    clip_grad_by_total_norm_fp32([b], 1.0, torch.tensor(3.0), use_decoupled_grad=True)
    torch.testing.assert_close(b.decoupled_grad, torch.full((2,), 2.0 / 3.0))
    proxy = ProxyDict([{"x": 1}, {"y": 2}])
    assert dict(proxy.items()) == {(0, "x"): 1, (1, "y"): 2} and proxy[1, "y"] == 2 and len(proxy) == 2
