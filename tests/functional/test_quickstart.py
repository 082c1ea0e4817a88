"""scripts/quickstart.sh end to end (shortened): preprocess the shipped corpus, train, loss falls."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_script_preprocesses_trains_and_loss_falls(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "SKIP_INSTALL": "1", "TRAIN_ITERS": "20",
           "QUICKSTART_DIR": str(tmp_path / "processed"), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "quickstart.sh")], capture_output=True,
                       text=True, timeout=280, env=env, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert (tmp_path / "processed" / "corpus_text_document.bin").stat().st_size > 100_000
    iters = [int(i) for i in re.findall(r"^ \[[^\]]+\] iteration +(\d+)/ +20 \|", out, re.M)]
    assert iters == [1, 10, 20], iters
    assert re.search(r"^ validation loss at iteration 20 on validation set \| lm loss value: ", out, re.M)
    first, last = map(float, re.search(r"quickstart: lm loss (\S+) -> (\S+) \(falling", out).groups())
    assert last < first - 1.0, (first, last)  # ~9.0 -> ~7.5 after 20 iterations
    sample = re.search(r"^=== prompt: 'Return the'\nReturn the(.+)\n--- \d+ tokens \(", out, re.M | re.S)
    assert sample and sample.group(1).strip(), out[-2000:]  # the sample from the trained checkpoint
