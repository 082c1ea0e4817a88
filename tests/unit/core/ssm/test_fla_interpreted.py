"""fla 0.6.0's chunked gated delta rule with the PyTorch dq/dk/dw/dg step, run on CPU by Triton's interpreter
(fla_interpreted_worker.py, its own process since TRITON_INTERPRET must be set before Triton loads): the step equals
fla's Triton ``chunk_bwd_dqkwg`` (1e-5 relative, fp32), and the composed path equals fla's own function (1e-5) and
the eager scan (1e-4: fp32 rounding of two different chunk solvers), output, final state and every input gradient.
Skipped without triton 3.6 and flash-linear-attention 0.6.0."""
import importlib.metadata
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fla_interpreted_worker.py")


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# the worker's interpreter shims are written against Triton 3.6's interpreter (requirements-test.txt pins both)
@pytest.mark.skipif(not (_version("triton") or "").startswith("3.6.") or _version("flash-linear-attention") != "0.6.0",
                    reason="needs triton 3.6 and flash-linear-attention==0.6.0 (requirements-test.txt)")
def test_fla_with_torch_dqkwg_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert len(rows) == 4 * 2 + 8 * 3, proc.stdout
    bad = [" ".join(r) for r in rows if float(r[1]) > float(r[2])]
    assert not bad, "over tolerance (name, error, tolerance):\n" + "\n".join(bad)
