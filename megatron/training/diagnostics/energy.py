"""--log-energy in the training loop: the monitor (megatron.core.energy_monitor) counts from the start of
training to its end, paused around evaluation and checkpoint saves as in Megatron; each log point closes a
lap for the line's `energy per GPU (J/iter/GPU)` and `power per GPU (W/GPU)`, and the end prints the total
over all GPUs. Every rank calls these (laps are all-reduced); without --log-energy they do nothing."""
import contextlib
from typing import Optional, Tuple

from megatron.core.energy_monitor import energy_log_fields
from megatron.training.global_vars import get_energy_monitor
from megatron.training.utils import print_rank_0


def start() -> None:
    monitor = get_energy_monitor()
    if monitor is not None:
        monitor.setup()
        monitor.resume()


@contextlib.contextmanager
def paused():
    """Energy spent inside (evaluation, a checkpoint save) is not counted."""
    monitor = get_energy_monitor()
    if monitor is not None:
        monitor.pause()
    try:
        yield
    finally:
        if monitor is not None:
            monitor.resume()


def log_fields(iterations: int, seconds_per_iteration: float, world_size: int) -> Optional[Tuple[float, float]]:
    """(J per iteration per GPU, W per GPU) over the ``iterations`` since the last log point, or None."""
    monitor = get_energy_monitor()
    if monitor is None:
        return None
    return energy_log_fields(monitor.lap(), iterations, world_size, seconds_per_iteration)


def finish() -> None:
    """Close the last lap, print the run's energy over every GPU (Megatron's line) and release NVML."""
    monitor = get_energy_monitor()
    if monitor is None:
        return
    monitor.lap()
    print_rank_0(f"Total training energy (GPU): {monitor.get_total() / 1e6:.3f} MJ")
    monitor.shutdown()
