"""One GPU: --log-device-memory-used adds the driver's count of the device's used memory to the memory report."""
import pytest
import torch

from megatron.training.utils import report_memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_device_memory_used_is_reported():
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB held by this process
    line = report_memory("after", device_memory_used=True)
    used = float(line.rsplit("total device memory used: ", 1)[1])
    assert used >= 64 and "total device memory used" not in report_memory("after")
    del x
