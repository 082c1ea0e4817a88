"""One GPU: --log-energy's monitor reads the real NVML counter of the current device; a second of bf16 matmuls
draws a plausible power (well above idle, below any GPU's board limit), and a paused span is not counted."""
import time

import pytest
import torch

from megatron.core import energy_monitor
from megatron.core.energy_monitor import EnergyMonitor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not energy_monitor.has_nvml,
                                                  reason="needs CUDA and nvidia-ml-py")]


def test_real_counter_measures_a_busy_gpu():
    monitor = EnergyMonitor()
    monitor.setup()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    monitor.resume()
    start = time.time()
    while time.time() - start < 1.0:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    watts = monitor.lap() / (time.time() - start)
    monitor.pause()
    time.sleep(0.5)  # the counter updates every few ms: a paused span would show up if it were counted
    monitor.resume()
    assert monitor.lap() < 0.05 * watts
    assert 30 < watts < 1500, watts
    monitor.shutdown()
