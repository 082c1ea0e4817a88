"""GPU energy used by a run (--log-energy), read from NVML's total-energy counter of each rank's GPU.

The counter (``nvmlDeviceGetTotalEnergyConsumption``) is a running total in millijoules since the
driver loaded, so energy over a span is the difference of two readings. ``pause``/``resume`` leave
spans out (evaluation, checkpoint saves, as Megatron does); ``lap`` closes the span since the last
lap and sums it over the ranks of the group, so every rank must call ``lap`` and ``get_total``.
The NVML binding is ``nvidia-ml-py`` (module ``pynvml``); it is imported here, guarded, so that this
module loads on a CPU-only install.
"""
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core.utils import get_device

try:
    import pynvml
except ImportError:  # CPU installs; --log-energy is refused at start-up without it
    pynvml = None

has_nvml = pynvml is not None


def nvml_missing_reason() -> Optional[str]:
    """Why NVML energy readings cannot work in this process (None when they can): for start-up errors."""
    if not torch.cuda.is_available():
        return "it needs CUDA GPUs (NVML reads their energy counters); drop it on CPU"
    if pynvml is None:
        return "the NVML binding is missing: pip install nvidia-ml-py"
    return None


def _nvml_handle(device: int):
    """NVML handle of CUDA device ``device``, found by UUID: NVML numbers every GPU of the node while
    CUDA numbers only those in CUDA_VISIBLE_DEVICES, so the index alone can name another rank's GPU."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        text = str(uuid)  # torch prints the bare UUID; NVML's carries a "GPU-" prefix
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
        except pynvml.NVMLError:
            pass  # an older driver or a MIG instance: the index is right when every GPU is visible
    return pynvml.nvmlDeviceGetHandleByIndex(device)


class EnergyMonitor:
    """Energy (J) of training spans, summed over the ranks of ``group`` (default: every rank).

    ``read_counter`` returns the counter in millijoules; by default (None) ``setup`` reads this rank's
    current CUDA device through NVML. Megatron's method names: setup, shutdown, pause, resume, lap,
    get_total."""

    def __init__(self, group=None, read_counter: Optional[Callable[[], int]] = None) -> None:
        self._group = group
        self._read = read_counter
        self._owns_nvml = False
        self._total_mj = 0  # this rank's energy in closed laps
        self._lap_mj = 0  # this rank's energy in the open lap's finished spans
        self._running = False  # between resume and pause
        self._last_mj = None  # counter at the start of the running span; None while paused or after a failed read
        self._warned = False

    def setup(self) -> None:
        """Open NVML on this rank's current CUDA device (unless a counter was given) and read it once, so
        that a GPU without the counter fails here, with its name, rather than in the middle of a run."""
        if self._read is None:
            reason = nvml_missing_reason()
            if reason is not None:
                raise RuntimeError(f"--log-energy: {reason}")
            pynvml.nvmlInit()
            self._owns_nvml = True
            device = torch.cuda.current_device()
            try:
                handle = _nvml_handle(device)
                pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            except pynvml.NVMLError as e:
                raise RuntimeError(f"--log-energy: NVML cannot read the energy counter of CUDA device {device} "
                                   f"({torch.cuda.get_device_name(device)}): {e}") from e
            self._read = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)

    def shutdown(self) -> None:
        """Stop for good: later pause/resume/lap read nothing (a checkpoint save after training may still
        pause and resume)."""
        self._read, self._last_mj, self._running = None, None, False
        if self._owns_nvml:
            pynvml.nvmlShutdown()
            self._owns_nvml = False

    def _counter(self) -> Optional[int]:
        """The counter, or None when the read fails: a span without a reading at either end counts 0 J (with a
        warning once) rather than stopping training over a statistic, or measuring from a made-up start."""
        try:
            return int(self._read())
        except Exception as e:  # pynvml.NVMLError (or a fake counter's error)
            if not self._warned:
                self._warned = True
                warnings.warn(f"--log-energy: reading the GPU energy counter failed ({e}); spans without a "
                              f"reading count as 0 J")
            return None

    def _close_span(self) -> Optional[int]:
        """Add the running span to the open lap; returns the reading that ends it (None: the read failed)."""
        now = self._counter()
        if now is not None and self._last_mj is not None:
            self._lap_mj += now - self._last_mj
        return now

    def resume(self) -> None:
        """Start (or restart after ``pause``) counting; nothing before ``setup`` or after ``shutdown``."""
        if self._read is not None:
            self._running, self._last_mj = True, self._counter()

    def pause(self) -> None:
        """Stop counting until ``resume``; what ran since the last resume stays in the open lap."""
        if self._running:
            self._close_span()
            self._running, self._last_mj = False, None

    def lap(self) -> float:
        """Energy (J) since the previous lap, summed over the group's ranks; a collective. Counting goes on
        if it was running."""
        if self._running:
            self._last_mj = self._close_span()
        mj, self._lap_mj = self._lap_mj, 0
        self._total_mj += mj
        return self._sum_over_ranks(mj) / 1000.0

    def get_total(self) -> float:
        """Energy (J) of every closed lap, summed over the group's ranks; a collective."""
        return self._sum_over_ranks(self._total_mj) / 1000.0

    def _sum_over_ranks(self, mj: int) -> int:
        t = torch.tensor([mj], dtype=torch.int64, device=get_device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group)
        return int(t.item())


def energy_log_fields(lap_joules: float, iterations: int, world_size: int, seconds_per_iteration: float):
    """(energy per GPU per iteration in J, power per GPU in W) for the log line, from a lap summed over
    ``world_size`` GPUs that spanned ``iterations`` iterations (Megatron's arithmetic)."""
    energy = lap_joules / max(1, iterations) / world_size
    power = energy / seconds_per_iteration if seconds_per_iteration > 0 else 0.0
    return energy, power
