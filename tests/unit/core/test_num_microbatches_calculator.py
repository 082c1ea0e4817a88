"""Micro-batch calculator: constant and linear rampup (Megatron semantics)."""
import pytest

from megatron.core import num_microbatches_calculator as mbc
from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
)


def test_constant():
    c = ConstantNumMicroBatchesCalculator(32, 2, 4)
    assert c.get() == 4 and c.get_current_global_batch_size() == 32
    with pytest.raises(ValueError, match=r"global batch size \(30\) is not divisible"):
        ConstantNumMicroBatchesCalculator(30, 2, 4)
    d = ConstantNumMicroBatchesCalculator(30, 2, 4, decrease_batch_size_if_needed=True)
    assert d.get() == 3 and d.get_current_running_global_batch_size() == 24


def test_rampup_schedule():
    # start 8, +8 up to 32 over 300 samples: 3 increments, one every 100 samples.
    c = RampupBatchsizeNumMicroBatchesCalculator(32, 2, 2, False, 0, 8, 8, 300)
    expected = {0: 8, 99: 8, 100: 16, 199: 16, 200: 24, 299: 24, 300: 32, 301: 32, 10_000: 32}
    for consumed, gbs in expected.items():
        c.update(consumed, consistency_check=True)
        assert c.get_current_global_batch_size() == gbs, consumed
        assert c.get() == gbs // 4


def test_rampup_rejects_bad_increment():
    with pytest.raises(ValueError, match="multiple of the increment"):
        RampupBatchsizeNumMicroBatchesCalculator(30, 1, 1, False, 0, 8, 8, 100)


def test_global_api():
    mbc.unset_num_microbatches_calculator()
    mbc.init_num_microbatches_calculator(0, ["4", "4", "16"], 12, 2, 1)
    try:
        assert mbc.get_num_microbatches() == 2 and mbc.get_micro_batch_size() == 2
        mbc.update_num_microbatches(8)
        assert mbc.get_current_global_batch_size() == 8
        with pytest.raises(AssertionError):
            mbc.init_num_microbatches_calculator(0, None, 8, 2, 1)
    finally:
        mbc.unset_num_microbatches_calculator()


@pytest.mark.parametrize("schedule", ["0:4 10:8 30:2", "0:6", "0:2 1:4 2:8 100:16", "0:8 3K:16"])
def test_step_schedule_walks_equal_the_step_by_step_run(schedule):
    """`samples_after(n)` is what n steps consume and `segments(total)` the steps of a run of `total` samples: both
    equal to stepping the calculator one global batch at a time, as the training loop does."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator
    calc = StepBatchsizeNumMicroBatchesCalculator(1, 1, False, 1, schedule)
    consumed, walk = 0, [0]
    for _ in range(60):
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        walk.append(consumed)
    assert [calc.samples_after(n) for n in range(61)] == walk
    for total in (0, 1, 7, 10, 11, 35, 100, 101):
        steps = sum(n for n, _, _ in calc.segments(total))
        # The run's steps are the most whose samples fit in `total` (whole global batches only).
        assert walk[steps] <= total < walk[steps + 1], (total, steps)
        assert [start for _, _, start in calc.segments(total)] == [calc.samples_after(
            sum(n for n, _, _ in calc.segments(total)[:i])) for i in range(len(calc.segments(total)))]
