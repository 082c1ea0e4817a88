"""Megatron loss-scaler semantics."""
import pytest

from megatron.core.optimizer import ConstantGradScaler, DynamicGradScaler


def _dyn(**kw):
    args = dict(initial_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=3, hysteresis=2)
    args.update(kw)
    return DynamicGradScaler(**args)


def test_growth_after_window_of_clean_steps():
    s = _dyn()
    for _ in range(2):
        s.update(False)
    assert s.scale.item() == 2.0 ** 32
    s.update(False)
    assert s.scale.item() == 2.0 ** 33
    assert s.inv_scale.item() == pytest.approx(2.0 ** -33)


def test_backoff_after_hysteresis_overflows_and_floor():
    s = _dyn(initial_scale=4.0, min_scale=1.0)
    s.update(True)
    assert s.scale.item() == 4.0  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale.item() == 2.0
    s.update(True)  # tracker stays exhausted: every further overflow halves
    assert s.scale.item() == 1.0
    s.update(True)
    assert s.scale.item() == 1.0  # floor
    s.update(False)  # a clean step does not reset hysteresis until the window completes
    s.update(True)
    assert s.scale.item() == 1.0


def test_growth_resets_hysteresis():
    s = _dyn(initial_scale=8.0)
    s.update(True)
    for _ in range(3):
        s.update(False)
    assert s.scale.item() == 16.0
    s.update(True)
    assert s.scale.item() == 16.0  # hysteresis back to 2


def test_state_dict_round_trip():
    s = _dyn()
    s.update(True)
    s.update(False)
    t = _dyn(initial_scale=1.0)
    t.load_state_dict(s.state_dict())
    assert t.scale.item() == s.scale.item()
    assert t.state_dict()["growth_tracker"] == 1 and t.state_dict()["hysteresis_tracker"] == 1


def test_constant():
    s = ConstantGradScaler(128.0)
    s.update(True)
    assert s.scale.item() == 128.0
    with pytest.raises(ValueError):
        ConstantGradScaler(0.0)
