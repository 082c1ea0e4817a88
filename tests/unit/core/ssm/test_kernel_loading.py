"""Loading the optional Triton scan kernels: Triton's autotuning results are kept on disk for the next process
(TRITON_CACHE_AUTOTUNING, read when the kernels' modules are imported), unless the environment chose otherwise."""
import os

import pytest

from megatron.core.ssm.ops import kernels


@pytest.mark.parametrize("preset,expected", [(None, "1"), ("0", "0")])
def test_loading_the_kernels_keeps_autotuning_on_disk_unless_told_not_to(monkeypatch, preset, expected):
    if preset is None:
        monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", preset)
    seen = []
    real_import = kernels.importlib.import_module

    def record(name, *args):  # the environment as each kernel module is imported
        seen.append((name, os.environ.get("TRITON_CACHE_AUTOTUNING")))
        raise ImportError(f"{name} is not installed here")

    monkeypatch.setattr(kernels.importlib, "import_module", record)
    try:
        assert kernels.load_mamba_ssm_triton() is None
    finally:
        monkeypatch.setattr(kernels.importlib, "import_module", real_import)
    assert seen and all(value == expected for _, value in seen)
