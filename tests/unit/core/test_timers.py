"""Timers: accumulation, levels, and the '(min, max)' report."""
import time

from megatron.core.timers import DummyTimer, Timers


def test_accumulates_and_resets():
    timers = Timers(log_level=1, log_option="minmax")
    t = timers("step", log_level=1)
    for _ in range(2):
        t.start()
        time.sleep(0.01)
        t.stop()
    assert t.elapsed(reset=True) >= 0.02
    assert t.elapsed() == 0.0


def test_levels_hide_fine_timers():
    timers = Timers(log_level=0, log_option="max")
    assert isinstance(timers("forward-compute", log_level=2), DummyTimer)
    assert not isinstance(timers("interval-time", log_level=0), DummyTimer)


def test_report_format(capsys):
    timers = Timers(log_level=2, log_option="minmax")
    t = timers("forward-backward", log_level=1)
    t.start()
    time.sleep(0.002)
    t.stop()
    timers.log(["forward-backward", "missing"], normalizer=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "(min, max) time across ranks (ms):"
    assert out[1].startswith("    forward-backward ....") and ": (" in out[1] and len(out) == 2
