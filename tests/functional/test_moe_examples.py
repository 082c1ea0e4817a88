"""The tiny MoE examples run for real on CPU (2 gloo ranks, EP=2): loss falls and the log line carries the
MoE fields after 'lm loss' (Megatron's names) and the expert load spread."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("script,field", [("mixtral/train_mixtral_tiny_cpu.sh", "load_balancing_loss"),
                                          ("deepseek/train_deepseek_moe_tiny_cpu.sh", "seq_load_balancing_loss")])
def test_tiny_moe_example_trains(script, field):
    env = {**os.environ, "TRAIN_ITERS": "8", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", *script.split("/"))], capture_output=True,
                       text=True, timeout=240, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    lines = re.findall(r"iteration +\d+/ +8 \|.*", out)
    losses = [float(x) for x in re.findall(r"iteration +\d+/ +8 \|.*?\| lm loss: (\S+) \|", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses  # iterations 1, 4, 8
    balance = float(re.search(rf"\| {field}: (\S+) \|", lines[-1]).group(1))
    assert 0.9 < balance < 2.0  # E * sum f_i P_i is 1 when perfectly balanced
    assert lines[-1].index("lm loss:") < lines[-1].index(field) < lines[-1].index("moe max load:")
