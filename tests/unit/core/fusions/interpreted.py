"""Running a Triton kernel check under Triton's CPU interpreter: in its own process, since TRITON_INTERPRET must be
set before Triton loads. A worker prints "name error tolerance" per compared tensor."""
import importlib.metadata
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def _triton_version():
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return ""


needs_triton3 = pytest.mark.skipif(not _triton_version().startswith("3."),
                                   reason="needs Triton 3 (requirements-test.txt)")


def check_worker(worker: str, expected_rows: int) -> None:
    """Run ``worker`` (a file next to this one) under the interpreter; every row within its tolerance."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), worker)
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert len(rows) == expected_rows, proc.stdout
    bad = [" ".join(r) for r in rows if float(r[1]) > float(r[2])]
    assert not bad, "over tolerance (case, error, tolerance):\n" + "\n".join(bad)
