"""examples/deepseek_v3 tiny CPU run end to end: MLA + YaRN, dense then MoE layers at EP=2, one MTP depth.
The log line carries `mtp_1 loss` next to `lm loss`; validation and perplexity report the main prediction only."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_deepseek_v3_trains_and_logs_mtp_loss():
    env = {**os.environ, "TRAIN_ITERS": "10",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", "deepseek_v3", "train_deepseek_v3_tiny_cpu.sh")],
                       capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    lines = re.findall(r"iteration +\d+/ +10 \|.*", out)
    assert len(lines) == 3, out[-3000:]  # iterations 1, 5, 10
    lm = [float(re.search(r"\| lm loss: (\S+) \|", line).group(1)) for line in lines]
    mtp = [float(re.search(r"\| lm loss: \S+ \| mtp_1 loss: (\S+) \|", line).group(1)) for line in lines]
    assert lm[-1] < lm[0] - 0.3 and mtp[-1] < mtp[0], (lm, mtp)
    validation = re.findall(r"validation loss at .*", out)
    assert validation and all("lm loss value" in v and "mtp" not in v for v in validation), validation
