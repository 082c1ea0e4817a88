"""scripts/run_gpu_tests_lanes.sh schedules the GPU suite: every file once, one-GPU files on one device, two-GPU
files on a pair, four-GPU files on four, with one or two lanes per GPU and a class filter. Run here with a stand-in
for scripts/run_gpu_tests.sh that records where each file would run, and a stand-in python that reports the GPUs."""
import os
import shutil
import subprocess

import pytest

from tests import ROOT


def _schedule(tmp_path, gpus, **env):
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copytree(os.path.join(ROOT, "tests", "gpu"), tree / "tests" / "gpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "scripts", "run_gpu_tests_lanes.sh"), tree / "scripts")
    runs = tmp_path / "runs.txt"
    (tree / "scripts" / "run_gpu_tests.sh").write_text(
        f'echo "$CUDA_VISIBLE_DEVICES $1" >> {runs}\necho "GPU tests: 1 passed, 0 failed, 0 skipped, 0 errors"\n')
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho {gpus}\n")
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(tree / "scripts" / "run_gpu_tests_lanes.sh")], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHON=str(fake), LOG_DIR=str(tmp_path / "logs"), **env))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = runs.read_text().splitlines() if runs.exists() else []
    return [(devices, os.path.basename(path)) for devices, path in (line.split() for line in lines)]


def _needs(name):
    text = open(os.path.join(ROOT, "tests", "gpu", name)).read()
    return 4 if "device_count() < 4" in text else 2 if "device_count() < 2" in text else 1


@pytest.mark.parametrize("lanes", ["1", "2"])
def test_every_file_once_on_the_devices_it_needs(tmp_path, lanes):
    runs = _schedule(tmp_path, 4, LANES_PER_GPU=lanes)
    files = sorted(f for f in os.listdir(os.path.join(ROOT, "tests", "gpu"))
                   if f.startswith("test_") and f.endswith(".py"))
    assert sorted(name for _, name in runs) == files
    for devices, name in runs:
        assert len(devices.split(",")) == _needs(name), (devices, name)
        assert devices in ({"1": ("0", "1", "2", "3"), "2": ("0,1", "2,3"), "4": ("0,1,2,3",)}[str(_needs(name))])


def test_classes_filter(tmp_path):
    runs = _schedule(tmp_path, 4, CLASSES="two four", LANES_PER_GPU="2")
    assert runs and all(_needs(name) > 1 for _, name in runs)


def test_files_filter(tmp_path):
    """FILES names the files to run (the ones a cut-off call left), each on the devices it needs."""
    runs = _schedule(tmp_path, 4, FILES="test_profiler_gpu test_async_save_gpu test_moe_overlap_gpu")
    assert sorted(name for _, name in runs) == ["test_async_save_gpu.py", "test_moe_overlap_gpu.py",
                                                "test_profiler_gpu.py"]
    assert all(len(devices.split(",")) == _needs(name) for devices, name in runs)
