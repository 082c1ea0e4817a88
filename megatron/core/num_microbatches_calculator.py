"""How many micro-batches make up the current global batch, with optional linear batch-size rampup.

Global state like Megatron Core's: `init_num_microbatches_calculator(...)` once, then
`get_num_microbatches()` / `get_current_global_batch_size()` / `update_num_microbatches(consumed)`.
"""
import logging
from abc import ABC, abstractmethod
from typing import List, Optional, Tuple

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


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]] = None,
                                     global_batch_size: Optional[int] = None,
                                     micro_batch_size: Optional[int] = None,
                                     data_parallel_size: Optional[int] = None,
                                     decrease_batch_size_if_needed: bool = False,
                                     step_batch_size_schedule: Optional[str] = None,
                                     seq_length: Optional[int] = None) -> None:
    """Create the global calculator (error if one exists).

    `rampup_batch_size` ([start, increment, samples]) keeps working here, although Megatron 0.19
    ignores it in favour of `step_batch_size_schedule` ("THRESHOLD:BS ...", see
    StepBatchsizeNumMicroBatchesCalculator); passing both is an error."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    assert _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None, "num microbatches calculator is already initialized"
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed, step_batch_size_schedule, seq_length)


def reconfigure_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]] = None,
                                            global_batch_size: Optional[int] = None,
                                            micro_batch_size: Optional[int] = None,
                                            data_parallel_size: Optional[int] = None,
                                            decrease_batch_size_if_needed: bool = False,
                                            step_batch_size_schedule: Optional[str] = None,
                                            seq_length: Optional[int] = None) -> None:
    """Replace the global calculator (e.g. evaluation with another batch size)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed, step_batch_size_schedule, seq_length)


def _build_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                                       data_parallel_size, decrease_batch_size_if_needed,
                                       step_batch_size_schedule=None, seq_length=None):
    if micro_batch_size is None or data_parallel_size is None:
        raise ValueError("num microbatches calculator: micro_batch_size and data_parallel_size are required")
    if step_batch_size_schedule is not None:
        if rampup_batch_size is not None:
            raise ValueError("--rampup-batch-size and --step-batch-size-schedule are exclusive; use one")
        return StepBatchsizeNumMicroBatchesCalculator(micro_batch_size, data_parallel_size,
                                                      decrease_batch_size_if_needed, rank,
                                                      step_batch_size_schedule, seq_length)
    if global_batch_size is None:
        raise ValueError("num microbatches calculator: global_batch_size is required without a "
                         "step batch size schedule")
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



_SUFFIX = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


class StepBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Global batch size that steps up at thresholds: "0:768 250B:1536 500B:3072".

    Thresholds are samples, or tokens when `seq_length` is given (then divided by it); K/M/B/T
    suffixes scale by 1e3/1e6/1e9/1e12. The last entry's size is the final global batch size."""

    def __init__(self, micro_batch_size: int, data_parallel_size: int, decrease_batch_size_if_needed: bool,
                 rank: int, schedule: str, seq_length: Optional[int] = None) -> None:
        super().__init__()
        if decrease_batch_size_if_needed:
            raise ValueError("--step-batch-size-schedule cannot be combined with --decrease-batch-size-if-needed")
        self.micro_batch_size, self.data_parallel_size, self.rank = micro_batch_size, data_parallel_size, rank
        self.seq_length = seq_length
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.schedule = self._parse_schedule(schedule, seq_length)
        self.global_batch_size = self.schedule[-1][1]
        self.update(0, consistency_check=False)

    @staticmethod
    def _parse_schedule(text: str, seq_length: Optional[int]) -> List[Tuple[int, int]]:
        steps = []
        for entry in text.replace(",", " ").split():
            if ":" not in entry:
                raise ValueError(f"--step-batch-size-schedule entry '{entry}': expected THRESHOLD:BATCH_SIZE")
            threshold, size = (_parse_count(v) for v in entry.split(":", 1))
            steps.append((threshold // seq_length if seq_length else threshold, size))
        steps.sort()
        if not steps or steps[0][0] != 0:
            raise ValueError("--step-batch-size-schedule must start at threshold 0 (e.g. '0:256 1M:512')")
        if any(a[0] == b[0] for a, b in zip(steps, steps[1:])) or any(s <= 0 for _, s in steps):
            raise ValueError("--step-batch-size-schedule: thresholds must differ and batch sizes be positive")
        return steps

    def segments(self, total_samples: int) -> List[Tuple[int, int, int]]:
        """(iterations, global batch size, samples consumed at its start) of each stretch of a run of
        ``total_samples`` at one batch size, in order: the most whole steps whose samples fit in ``total_samples``
        (the constant batch size's --train-samples rule). A step that starts before a threshold runs at the size
        before it."""
        out, consumed = [], 0
        for i, (_, size) in enumerate(self.schedule):
            fit = (total_samples - consumed) // size
            if i + 1 < len(self.schedule):
                fit = min(fit, max(0, -(-(self.schedule[i + 1][0] - consumed) // size)))
            if fit > 0:
                out.append((fit, size, consumed))
                consumed += fit * size
            if consumed + size > total_samples:  # the next step, at this size or a later one, does not fit
                nxt = self.schedule[i + 1][1] if i + 1 < len(self.schedule) else None
                if nxt is None or consumed < self.schedule[i + 1][0] or consumed + nxt > total_samples:
                    break
        return out

    def samples_after(self, iterations: int) -> int:
        """The samples the first ``iterations`` steps consume."""
        consumed = 0
        for i, (_, size) in enumerate(self.schedule):
            if iterations <= 0:
                break
            nxt = self.schedule[i + 1][0] if i + 1 < len(self.schedule) else None
            steps = iterations if nxt is None else min(iterations, max(0, -(-(nxt - consumed) // size)))
            consumed += steps * size
            iterations -= steps
        return consumed

    def update(self, consumed_samples, consistency_check, verbose=False):
        current = [size for threshold, size in self.schedule if consumed_samples >= threshold][-1]
        per_step = self.micro_batch_times_data_parallel_size
        if consistency_check and current % per_step != 0:
            raise ValueError(f"current global batch size ({current}) is not divisible by micro batch size "
                             f"({self.micro_batch_size}) times data parallel size ({self.data_parallel_size})")
        self.current_global_batch_size = self.current_running_global_batch_size = current
        self.num_micro_batches = current // per_step
        if verbose and self.rank == 0:
            logger.info("setting current global batch size to %d", current)
