"""Named wall-clock timers with Megatron's levels and its "(min, max) time across ranks" report.

`timers('forward-backward', log_level=1).start()`; timers above the configured level are no-ops
(`DummyTimer`) so instrumented code costs nothing when timing is off.
"""
import time
from abc import ABC, abstractmethod

import torch

from megatron.core.full_cuda_graph import is_graph_capturing


def _synchronize():
    # Device work is asynchronous: wait for it so a timer measures the work, not its launch.
    # Not while a CUDA graph is being captured: syncing is illegal there.
    if torch.cuda.is_available() and torch.cuda.is_initialized() and not is_graph_capturing():
        torch.cuda.synchronize()


def _barrier(barrier):
    if barrier and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class TimerBase(ABC):
    def __init__(self, name):
        self.name = name

    @abstractmethod
    def start(self, barrier=False):
        ...

    @abstractmethod
    def stop(self, barrier=False):
        ...

    @abstractmethod
    def reset(self):
        ...

    @abstractmethod
    def elapsed(self, reset=True, barrier=False):
        ...


class DummyTimer(TimerBase):
    """Timer above the logging level: does nothing."""

    def __init__(self):
        super().__init__("dummy timer")

    def start(self, barrier=False):
        return

    def stop(self, barrier=False):
        return

    def reset(self):
        return

    def elapsed(self, reset=True, barrier=False):
        raise RuntimeError("dummy timer should not be used to calculate elapsed time")

    def active_time(self):
        return 0.0


class Timer(TimerBase):
    """Accumulating timer: start/stop pairs add up until `elapsed(reset=True)` reads and clears."""

    def __init__(self, name):
        super().__init__(name)
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._start_time = time.time()

    def start(self, barrier=False):
        assert not self._started, f"timer {self.name} has already been started"
        _barrier(barrier)
        _synchronize()
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier=False):
        assert self._started, f"timer {self.name} is not started"
        _barrier(barrier)
        _synchronize()
        delta = time.time() - self._start_time
        self._elapsed += delta
        self._active_time += delta
        self._started = False

    def reset(self):
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset=True, barrier=False):
        """Seconds accumulated so far (a running timer is stopped, read and restarted)."""
        started = self._started
        if started:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if started:
            self.start(barrier=barrier)
        return value

    def active_time(self):
        return self._active_time


class Timers:
    """Registry of timers; `log_level` hides finer timers, `log_option` picks max / minmax / all."""

    def __init__(self, log_level, log_option):
        if log_option not in ("max", "minmax", "all"):
            raise ValueError(f"--timing-log-option must be max, minmax or all, got {log_option}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers = {}
        self._log_levels = {}
        self._dummy_timer = DummyTimer()
        self._max_log_level = 2

    def __call__(self, name, log_level=None):
        if name in self._timers:
            if log_level is not None:
                assert log_level == self._log_levels[name], f"timer {name} re-registered at another level"
            return self._timers[name]
        if log_level is None:
            log_level = self._max_log_level
        assert log_level <= self._max_log_level, f"log level {log_level} above max {self._max_log_level}"
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _elapsed_all_ranks(self, names, reset, barrier):
        """[world, len(names)] seconds; 0 where a rank has no such timer."""
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        world = torch.distributed.get_world_size() if dist else 1
        local = torch.zeros(len(names), dtype=torch.float)
        for i, name in enumerate(names):
            if name in self._timers:
                local[i] = self._timers[name].elapsed(reset=reset, barrier=barrier)
        if not dist or world == 1:
            return local.unsqueeze(0)
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        gathered = [torch.zeros(len(names), dtype=torch.float, device=device) for _ in range(world)]
        torch.distributed.all_gather(gathered, local.to(device))
        return torch.stack(gathered).cpu()

    def _get_string(self, names, reset, barrier, normalizer):
        assert normalizer > 0.0
        times = self._elapsed_all_ranks(names, reset, barrier) * 1000.0 / normalizer
        if self._log_option == "all":
            out = "times across ranks (ms):"
            for i, name in enumerate(names):
                out += f"\n  {name}:"
                for r in range(times.shape[0]):
                    out += f"\n     rank {r:2d}: {times[r, i]:.2f}"
            return out
        header = "max time across ranks (ms):" if self._log_option == "max" else "(min, max) time across ranks (ms):"
        out = header
        for i, name in enumerate(names):
            col = times[:, i]
            present = col[col > 0.0]
            if present.numel() == 0:
                continue
            label = f"    {name} ".ljust(48, ".")
            if self._log_option == "max":
                out += f"\n{label}: {present.max().item():.2f}"
            else:
                out += f"\n{label}: ({present.min().item():.2f}, {present.max().item():.2f})"
        return out if out != header else None

    def log(self, names, rank=None, normalizer=1.0, reset=True, barrier=False):
        """Print the report on `rank` (default: last rank). All ranks must call it (it all-gathers)."""
        text = self._get_string(names, reset, barrier, normalizer)
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        if rank is None:
            rank = torch.distributed.get_world_size() - 1 if dist else 0
        me = torch.distributed.get_rank() if dist else 0
        if text is not None and me == rank:
            print(text, flush=True)

    def write(self, names, writer, iteration, normalizer=1.0, reset=False, barrier=False):
        """Write each timer's max across ranks to TensorBoard as `<name>-time`."""
        times = self._elapsed_all_ranks(names, reset, barrier) * 1.0 / normalizer
        if writer is None:
            return
        for i, name in enumerate(names):
            writer.add_scalar(f"{name}-time", times[:, i].max().item(), iteration)
