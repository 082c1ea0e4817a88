"""The launch order of the overlapped MoE schedule's two host threads: whatever the threads' timing, one
window launches the same sequence of collectives (the merge by place within each side), a side that ends or
fails releases the other, and outside a window nothing waits."""
import random
import threading
import time

import pytest

from megatron.core.transformer.moe.launch_order import BACKWARD, FORWARD, LaunchOrder


def _merge(f, b):
    """The expected sequence: forward k before backward j when k / F <= j / B."""
    keys = [(k / f, 0, FORWARD) for k in range(f)] + [(j / b, 1, BACKWARD) for j in range(b)]
    return [side for _, _, side in sorted(keys)]


def _window(order, f, b, seed, fail_side=None, record=False):
    """One window: two threads launching f and b 'collectives' with random host delays between them."""
    rng = random.Random(seed)
    delays = {s: [rng.random() * 2e-3 for _ in range(n)] for s, n in ((FORWARD, f), (BACKWARD, b))}
    errors = []

    def side(s, n):
        try:
            for i in range(n):
                time.sleep(delays[s][i])
                if s == fail_side and i == n // 2:
                    raise RuntimeError("side failed")
                with order.turn(s):
                    pass
        except RuntimeError as e:
            errors.append(e)
        finally:
            order.finish(s)

    with order.window(record=record):
        if record:  # the first step: one side after the other
            side(FORWARD, f)
            side(BACKWARD, b)
        else:
            t = threading.Thread(target=side, args=(FORWARD, f))
            t.start()
            side(BACKWARD, b)
            t.join(timeout=30)
            assert not t.is_alive(), "the forward side never finished"
    return errors


@pytest.mark.parametrize("f,b", [(3, 2), (6, 4), (2, 5), (1, 1), (4, 0)])
def test_every_timing_launches_the_one_merged_sequence(f, b):
    order = LaunchOrder()
    order.trace = []
    _window(order, f, b, seed=0, record=True)
    assert order.per_window == [f, b]
    assert order.trace == [FORWARD] * f + [BACKWARD] * b  # counted in program order, nothing waited
    expected = _merge(f, b)
    for seed in range(12):
        order.trace = []
        assert _window(order, f, b, seed=seed + 1) == []
        assert order.trace == expected, f"seed {seed + 1}"


def test_without_the_order_timing_decides():
    """The check above can fail: with no counts the two sides interleave by timing, and some timings differ."""
    seen = set()
    for seed in range(12):
        order = LaunchOrder()
        order.trace = []
        _window(order, 3, 2, seed=seed)  # per_window [0, 0]: nothing to merge, no waiting
        seen.add(tuple(order.trace))
    assert len(seen) > 1


@pytest.mark.parametrize("fail_side", [FORWARD, BACKWARD])
def test_a_failing_side_releases_the_other(fail_side):
    order = LaunchOrder()
    _window(order, 6, 4, seed=0, record=True)
    errors = _window(order, 6, 4, seed=3, fail_side=fail_side)
    assert [str(e) for e in errors] == ["side failed"]


def test_outside_a_window_nothing_waits_or_counts():
    order = LaunchOrder()
    order.per_window = [3, 2]
    order.trace = []
    for _ in range(5):
        with order.turn(BACKWARD):
            pass
    assert order.trace == [] and order._launched == [0, 0]
