"""One GPU, pretrain_gpt.py with Megatron's default checks on (NaN/Inf of the loss, of each gradient bucket):
a step's forward/backward over 4 micro-batches makes no device-to-host wait per micro-batch. The batch copies
are non-blocking, the checks' verdicts are read once when the step's pass ends, and the token-count scaling
stays on the device; a synchronisation per micro-batch stops the host from queueing work ahead of the GPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.benchmark_runs import failure_text

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-3 --bf16 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 1024 --eval-iters 0 --log-interval 1 --num-workers 1 "
         "--use-distributed-optimizer").split()

# Counts torch's "synchronizing CUDA operation" warnings inside each step's forward/backward (the training
# loop's own per-step reads, the log line and the optimizer's grad norm, are outside it).
DRIVER = """
import json, runpy, sys, warnings
import torch
import megatron.training.training as training
out, record, real = sys.argv[1], [], training.get_training_forward_backward_func
def counted():
    fbf = real()
    def run(**kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return fbf(**kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                record.append([f"{w.filename}:{w.lineno}: {str(w.message)[:80]}" for w in caught
                               if "synchroniz" in str(w.message)])
    return run
training.get_training_forward_backward_func = counted
sys.argv = ["pretrain_gpt.py"] + sys.argv[2:]
try:
    runpy.run_path("pretrain_gpt.py", run_name="__main__")
finally:
    json.dump(record, open(out, "w"))
"""


def test_step_makes_no_synchronisation_per_micro_batch(tmp_path):
    driver, out = tmp_path / "driver.py", tmp_path / "syncs.json"
    driver.write_text(DRIVER)
    p = subprocess.run([sys.executable, str(driver), str(out)] + FLAGS, cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, failure_text(p)
    steps = json.loads(out.read_text())
    assert len(steps) == 6
    for i, syncs in enumerate(steps[2:], start=3):  # the first steps warm up allocators and kernel caches
        print(f"iteration {i}: {len(syncs)} synchronisations", *syncs, sep="\n  ")
        assert len(syncs) < 4, f"iteration {i}: a synchronisation per micro-batch (4 micro-batches): {syncs}"
