"""scripts/run_gpu_tests_lanes.sh schedules the GPU suite: every file once, one-GPU files on one device, two-GPU
files on a pair, four-GPU files on four, with one or two lanes per GPU and a class filter. Run here with a stand-in
for scripts/run_gpu_tests.sh that records where each file would run, and a stand-in python that reports the GPUs."""
import os
import shutil
import signal
import subprocess
import time

import pytest

from tests import ROOT


def _tree(tmp_path):
    """A copy of the lanes script and tests/gpu, where the test puts its stand-in scripts/run_gpu_tests.sh."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copytree(os.path.join(ROOT, "tests", "gpu"), tree / "tests" / "gpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "scripts", "run_gpu_tests_lanes.sh"), tree / "scripts")
    return tree


def _schedule(tmp_path, gpus, **env):
    tree = _tree(tmp_path)
    runs = tmp_path / "runs.txt"
    (tree / "scripts" / "run_gpu_tests.sh").write_text(
        f'sel=none; [ "$2" = "-m" ] && sel="$3"\necho "$CUDA_VISIBLE_DEVICES $1 $sel" >> {runs}\n'
        'echo "GPU tests: 1 passed, 0 failed, 0 skipped, 0 errors"\n')
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho {gpus}\n")
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(tree / "scripts" / "run_gpu_tests_lanes.sh")], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHON=str(fake), LOG_DIR=str(tmp_path / "logs"), **env))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = runs.read_text().splitlines() if runs.exists() else []
    return [(devices, os.path.basename(path), sel) for devices, path, sel in
            (line.split(" ", 2) for line in lines)]


def _text(name):
    return open(os.path.join(ROOT, "tests", "gpu", name)).read()


def _mixed(name):
    """Two-GPU tests and `four_gpus`-marked four-GPU ones in one file."""
    text = _text(name)
    return "device_count() < 2" in text and "device_count() < 4" in text and "four_gpus" in text


def _needs(name, sel="none"):
    if _mixed(name):
        return 4 if sel == "four_gpus" else 2
    text = _text(name)
    return 4 if "device_count() < 4" in text else 2 if "device_count() < 2" in text else 1


@pytest.mark.parametrize("lanes", ["1", "2"])
def test_every_file_once_on_the_devices_it_needs(tmp_path, lanes):
    """Each file once; a file with four-GPU tests among two-GPU ones twice: the rest on a pair, those on four."""
    runs = _schedule(tmp_path, 4, LANES_PER_GPU=lanes)
    files = sorted(f for f in os.listdir(os.path.join(ROOT, "tests", "gpu"))
                   if f.startswith("test_") and f.endswith(".py"))
    mixed = [f for f in files if _mixed(f)]
    assert {"test_context_parallel_gpu.py", "test_moe_overlap_gpu.py"} <= set(mixed)
    assert sorted(name for _, name, _ in runs) == sorted(files + mixed)
    for devices, name, sel in runs:
        assert sel == ("none" if not _mixed(name) else "four_gpus" if devices == "0,1,2,3" else "not four_gpus")
        assert len(devices.split(",")) == _needs(name, sel), (devices, name, sel)
        assert devices in {1: ("0", "1", "2", "3"), 2: ("0,1", "2,3"), 4: ("0,1,2,3",)}[_needs(name, sel)]


def test_classes_filter(tmp_path):
    runs = _schedule(tmp_path, 4, CLASSES="two four", LANES_PER_GPU="2")
    assert runs and all(_needs(name, sel) > 1 for _, name, sel in runs)


def test_files_filter(tmp_path):
    """FILES names the files to run (the ones a cut-off call left), each on the devices it needs."""
    runs = _schedule(tmp_path, 4, FILES="test_profiler_gpu test_async_save_gpu test_moe_overlap_gpu")
    assert sorted(name for _, name, _ in runs) == ["test_async_save_gpu.py", "test_moe_overlap_gpu.py",
                                                   "test_moe_overlap_gpu.py", "test_profiler_gpu.py"]
    assert all(len(devices.split(",")) == _needs(name, sel) for devices, name, sel in runs)


def test_stopped_from_outside_takes_the_lanes_down_and_still_reports(tmp_path):
    """A device call's time limit stops the script with SIGTERM: the files still running are killed with
    everything they started (no process keeps its GPUs), and the summary names what passed, with seconds, and
    the test each unfinished file was in."""
    tree = _tree(tmp_path)
    pids = tmp_path / "pids"
    pids.mkdir()
    # The profiler file hangs in its test (a child that never ends); every other file passes at once.
    (tree / "scripts" / "run_gpu_tests.sh").write_text(
        'case "$1" in\n'
        '  *test_profiler_gpu.py) echo "tests/gpu/test_profiler_gpu.py::test_traces_on_both_ranks "\n'
        f'    sleep 300 & echo $! > {pids}/sleep; wait ;;\n'
        '  *) echo "GPU tests: 1 passed, 0 failed, 0 skipped, 0 errors" ;;\n'
        'esac\n')
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 2\n")
    fake.chmod(0o755)
    p = subprocess.Popen(["bash", str(tree / "scripts" / "run_gpu_tests_lanes.sh")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHON=str(fake), LOG_DIR=str(tmp_path / "logs"),
                                  FILES="test_profiler_gpu test_async_save_gpu"))
    deadline = time.time() + 120
    while not (pids / "sleep").exists() or not (tmp_path / "logs" / "test_async_save_gpu.log").exists() or \
            "GPU lanes:" not in (tmp_path / "logs" / "test_async_save_gpu.log").read_text():
        assert time.time() < deadline and p.poll() is None, "the lanes did not start both files"
        time.sleep(0.2)
    sleeper = int((pids / "sleep").read_text())
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 124, out
    assert "GPU lanes: stopped from outside" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("test_")}
    assert "GPU tests: 1 passed" in lines["test_async_save_gpu.py"] and " s)" in lines["test_async_save_gpu.py"]
    assert "stopped before the end, in test_profiler_gpu.py::test_traces_on_both_ranks" in lines["test_profiler_gpu.py"]
    deadline = time.time() + 30
    while os.path.exists(f"/proc/{sleeper}") and open(f"/proc/{sleeper}/stat").read().split()[2] != "Z":
        assert time.time() < deadline, "the unfinished file's process outlived the lanes"
        time.sleep(0.2)


def test_budget_starts_only_files_that_fit_and_records_durations(tmp_path):
    """BUDGET_S: a file whose expected seconds (tests/gpu/durations.txt) exceed what is left is not started and
    the summary says so (exit 1: the suite is not complete); the files that ran leave their seconds in
    $LOG_DIR/durations.txt for the table."""
    tree = _tree(tmp_path)
    (tree / "tests" / "gpu" / "durations.txt").write_text(
        "# comment\ntest_moe_overlap_gpu 900\ntest_moe_overlap_gpu.four 900\ntest_profiler_gpu 5\n")
    (tree / "scripts" / "run_gpu_tests.sh").write_text(
        f'echo "$1" >> {tmp_path}/ran.txt\necho "GPU tests: 1 passed, 0 failed, 0 skipped, 0 errors"\n')
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 2\n")
    fake.chmod(0o755)
    logs = tmp_path / "logs"
    p = subprocess.run(["bash", str(tree / "scripts" / "run_gpu_tests_lanes.sh")], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHON=str(fake), LOG_DIR=str(logs), BUDGET_S="600",
                                             FILES="test_profiler_gpu test_moe_overlap_gpu test_async_save_gpu"))
    assert p.returncode == 1, p.stdout + p.stderr
    ran = sorted(os.path.basename(line) for line in (tmp_path / "ran.txt").read_text().splitlines())
    assert ran == ["test_async_save_gpu.py", "test_profiler_gpu.py"]  # 5 s listed, 120 s by default: both fit
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line.startswith("test_")}
    assert "not started (~900 s expected" in lines["test_moe_overlap_gpu.py"]  # its two- and four-GPU parts
    assert sum("not started" in line for line in p.stdout.splitlines()) == 2
    assert "GPU tests: 1 passed" in lines["test_profiler_gpu.py"]
    recorded = dict(line.split() for line in (logs / "durations.txt").read_text().splitlines())
    assert set(recorded) == {"test_profiler_gpu", "test_async_save_gpu"} and all(v.isdigit() for v in recorded.values())
