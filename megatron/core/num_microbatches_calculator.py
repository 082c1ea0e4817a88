"""How many micro-batches make up the current global batch, with optional linear batch-size rampup.

Global state like Megatron Core's: `init_num_microbatches_calculator(...)` once, then
`get_num_microbatches()` / `get_current_global_batch_size()` / `update_num_microbatches(consumed)`.
"""
import logging
from abc import ABC, abstractmethod
from typing import List, Optional

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def get_num_microbatches() -> int:
    return _calculator().get()


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def get_current_running_global_batch_size() -> int:
    return _calculator().get_current_running_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().micro_batch_size


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False):
    _calculator().update(consumed_samples, consistency_check, verbose)


def _calculator():
    assert _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None, "num microbatches calculator is not initialized"
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def unset_num_microbatches_calculator():
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


destroy_num_microbatches_calculator = unset_num_microbatches_calculator


def init_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                                     data_parallel_size, decrease_batch_size_if_needed=False):
    """Create the global calculator (error if one exists)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    assert _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None, "num microbatches calculator is already initialized"
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed)


def reconfigure_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                                            data_parallel_size, decrease_batch_size_if_needed=False):
    """Replace the global calculator (e.g. evaluation with another batch size)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed)


def _build_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                                       data_parallel_size, decrease_batch_size_if_needed):
    if rampup_batch_size is None:
        calc = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                 decrease_batch_size_if_needed, rank)
        if rank == 0:
            logger.info("setting number of micro-batches to constant %d", calc.get())
        return calc
    if len(rampup_batch_size) != 3:
        raise ValueError("--rampup-batch-size expects 3 values: <start batch size> <batch size increment> "
                         "<ramp-up samples>")
    start, incr, samples = (int(v) for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                    decrease_batch_size_if_needed, rank, start, incr, samples)


class NumMicroBatchesCalculator(ABC):
    def __init__(self):
        self.num_micro_batches = None
        self.current_global_batch_size = None
        self.current_running_global_batch_size = None
        self.micro_batch_size = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_current_running_global_batch_size(self) -> int:
        return self.current_running_global_batch_size

    @abstractmethod
    def update(self, consumed_samples, consistency_check, verbose=False):
        ...


def _divide_batch(global_batch_size, micro_batch_size, data_parallel_size, decrease_if_needed, what):
    """(num_microbatches, running global batch) with the divisibility rule."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step != 0:
        if not decrease_if_needed:
            raise ValueError(
                f"{what} ({global_batch_size}) is not divisible by micro batch size ({micro_batch_size}) "
                f"times data parallel size ({data_parallel_size})")
    num = global_batch_size // per_step
    if num < 1:
        raise ValueError(f"{what} ({global_batch_size}) is smaller than micro batch size ({micro_batch_size}) "
                         f"times data parallel size ({data_parallel_size})")
    return num, num * per_step


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Fixed global batch: num_microbatches = GBS / (MBS * DP)."""

    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size,
                 decrease_batch_size_if_needed=False, rank=0):
        super().__init__()
        self.num_micro_batches, self.current_running_global_batch_size = _divide_batch(
            global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed,
            "global batch size")
        self.current_global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size

    def update(self, consumed_samples, consistency_check, verbose=False):
        pass


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Global batch grows from `start` by `increment` every ramp_samples / num_increments samples."""

    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed,
                 rank, start_global_batch_size, batch_size_increment, ramup_samples):
        super().__init__()
        if start_global_batch_size <= 0 or batch_size_increment <= 0 or ramup_samples < 0:
            raise ValueError("--rampup-batch-size values must be positive (start, increment) and >= 0 (samples)")
        diff = global_batch_size - start_global_batch_size
        if diff < 0 or diff % batch_size_increment != 0:
            raise ValueError(
                f"--rampup-batch-size: global batch size ({global_batch_size}) minus start batch size "
                f"({start_global_batch_size}) must be a non-negative multiple of the increment "
                f"({batch_size_increment})")
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.global_batch_size = global_batch_size
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        num_increments = diff // batch_size_increment
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments else 0
        self.update(0, consistency_check=False)

    def update(self, consumed_samples, consistency_check, verbose=False):
        if consumed_samples > self.ramup_samples or self.rampup_samples_per_increment == 0:
            current = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            current = min(self.start_global_batch_size + steps * self.batch_size_increment,
                          self.global_batch_size)
        per_step = self.micro_batch_size * self.data_parallel_size
        if consistency_check and not self.decrease_batch_size_if_needed and current % per_step != 0:
            raise ValueError(
                f"current global batch size ({current}) is not divisible by micro batch size "
                f"({self.micro_batch_size}) times data parallel size ({self.data_parallel_size})")
        self.current_global_batch_size = current
        self.num_micro_batches = max(current // per_step, 1)
        self.current_running_global_batch_size = self.num_micro_batches * per_step
        if verbose:
            logger.info("setting current global batch size to %d", current)
