"""OptimizerParamScheduler against closed forms at chosen sample counts."""
import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def _opt(groups=None):
    p = torch.nn.Parameter(torch.zeros(2))
    groups = groups or [{"params": [p]}]
    return torch.optim.SGD(groups, lr=0.0)


def _sched(style="linear", warmup=10, decay=110, init_lr=0.0, max_lr=1.0, min_lr=0.1, opt=None, **kw):
    kw.setdefault("start_wd", 0.1)
    kw.setdefault("end_wd", 0.1)
    kw.setdefault("wd_incr_steps", 100)
    kw.setdefault("wd_incr_style", "constant")
    return OptimizerParamScheduler(opt or _opt(), init_lr, max_lr, min_lr, warmup, decay, style, **kw)


def _lr_at(sched, n):
    sched.num_steps = 0
    sched.step(n)
    return sched.optimizer.param_groups[0]["lr"]


def test_warmup_is_linear_from_init_lr():
    s = _sched(init_lr=0.2)
    assert _lr_at(s, 0) == pytest.approx(0.2)
    assert _lr_at(s, 5) == pytest.approx(0.2 + 0.8 * 0.5)
    assert _lr_at(s, 10) == pytest.approx(1.0)


@pytest.mark.parametrize("style,coeff", [
    ("linear", lambda r: 1 - r),
    ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
    ("constant", lambda r: 1.0),
])
def test_decay_styles(style, coeff):
    s = _sched(style)
    for n in (10, 35, 60, 110):
        r = (n - 10) / 100
        expected = 1.0 if style == "constant" else 0.1 + coeff(r) * 0.9
        assert _lr_at(s, n) == pytest.approx(expected)
    assert _lr_at(s, 500) == pytest.approx(1.0 if style == "constant" else 0.1)


def test_inverse_square_root():
    s = _sched("inverse-square-root", warmup=4, decay=1000, min_lr=0.01)
    assert _lr_at(s, 16) == pytest.approx(1.0 * math.sqrt(4) / math.sqrt(16))
    assert _lr_at(s, 999) == pytest.approx(max(0.01, 2 / math.sqrt(999)))


@pytest.mark.parametrize("wsd_style,coeff", [
    ("linear", lambda r: 1 - r),
    ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
    ("exponential", lambda r: 2 * 0.5 ** r - 1),
    ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
])
def test_wsd(wsd_style, coeff):
    s = _sched("WSD", warmup=10, decay=110, wsd_decay_steps=40, lr_wsd_decay_style=wsd_style)
    assert _lr_at(s, 70) == pytest.approx(1.0)  # stable phase
    assert _lr_at(s, 80) == pytest.approx(0.1 + coeff(10 / 40) * 0.9)
    assert _lr_at(s, 110) == pytest.approx(0.1 + coeff(1.0) * 0.9)


@pytest.mark.parametrize("style,coeff", [
    ("linear", lambda r: r), ("cosine", lambda r: 0.5 * (math.cos(math.pi * (1 - r)) + 1))])
def test_weight_decay_increment(style, coeff):
    s = _sched(start_wd=0.0, end_wd=0.1, wd_incr_steps=100, wd_incr_style=style)
    for n in (0, 25, 100):
        s.num_steps = 0
        s.step(n)
        assert s.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1 * coeff(n / 100))
    s.num_steps = 0
    s.step(300)
    assert s.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1)


def test_group_multipliers_and_own_lr_range():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = _opt([{"params": [a], "lr_mult": 0.5, "wd_mult": 0.0},
                {"params": [b], "max_lr": 2.0, "min_lr": 0.2}])
    s = _sched(opt=opt, start_wd=0.1, end_wd=0.1)
    s.step(60)  # half way through linear decay
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * (0.1 + 0.5 * 0.9))
    assert opt.param_groups[0]["weight_decay"] == 0.0
    assert opt.param_groups[1]["lr"] == pytest.approx(0.2 + 0.5 * 1.8)
    assert opt.param_groups[1]["weight_decay"] == pytest.approx(0.1)


def test_state_dict_round_trip_and_checks():
    s = _sched()
    s.step(42)
    sd = s.state_dict()
    t = _sched()
    t.load_state_dict(sd)
    assert t.num_steps == 42 and t.optimizer.param_groups[0]["lr"] == pytest.approx(s.optimizer.param_groups[0]["lr"])
    strict = _sched(max_lr=0.5, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate"):
        strict.load_state_dict(sd)
    override = _sched(max_lr=0.5, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    override.load_state_dict(sd)
    assert override.max_lr == 0.5 and override.num_steps == 42


def test_bad_config_raises():
    with pytest.raises(ValueError, match="--min-lr"):
        _sched(min_lr=2.0)
    with pytest.raises(ValueError, match="WSD"):
        _sched("WSD")
