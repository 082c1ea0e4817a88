"""One GPU: --log-energy's monitor reads the real NVML counter of the current device; a second of bf16 matmuls
draws a plausible power (well above idle, below any GPU's board limit), and a paused span is not counted."""
import time

import pytest
import torch

from megatron.core import energy_monitor
from megatron.core.energy_monitor import EnergyMonitor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not energy_monitor.has_nvml,
                                                  reason="needs CUDA and nvidia-ml-py")]


def _busy(seconds, a):
    start = time.time()
    while time.time() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    return time.time() - start


def test_real_counter_measures_a_busy_gpu():
    monitor = EnergyMonitor()
    monitor.setup()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    monitor.resume()
    seconds = _busy(1.0, a)
    watts = monitor.lap() / seconds
    assert 30 < watts < 1500, watts
    # A paused span of the same busy work is left out. NVML's counter trails the GPU by its update period (tens
    # of ms, read as ~50 J on an H200), so the span after resume is a quiet 0.3 s whose reading may still carry
    # that tail: bounded by a third of the busy second, where counting the paused second would add ~all of it.
    monitor.pause()
    _busy(1.0, a)
    monitor.resume()
    time.sleep(0.3)
    after_pause = monitor.lap()
    assert after_pause < 0.35 * watts, (after_pause, watts)
    monitor.shutdown()
