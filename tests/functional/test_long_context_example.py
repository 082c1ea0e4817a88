"""examples/long_context/train_long_context_tiny_cpu.sh runs for real: CP=2 over 2 gloo ranks with packed
documents; every iteration logs a finite loss."""
import math
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_long_context_example_runs():
    env = {**os.environ, "TRAIN_ITERS": "3", "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "examples", "long_context", "train_long_context_tiny_cpu.sh")
    p = subprocess.run(["bash", script],
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "context-parallel size: 2" in p.stdout
    losses = [float(x) for x in re.findall(r"iteration +\d+/ +3 \|.*lm loss: (\S+) \|", p.stdout)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
