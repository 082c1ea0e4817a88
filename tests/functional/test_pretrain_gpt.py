"""The real CLI as a user runs it: torchrun with 2 processes, mock data, tiny GPT."""
import math
import os
import re

import pytest

from tests.functional.torchrun import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CMD = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
       "--micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-2 --lr-warmup-iters 2 --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 --eval-interval 10 --eval-iters 1 "
       "--num-workers 0 --log-throughput --timing-log-level 1")
LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +20 \| consumed samples: +(\d+) \| "
    r"elapsed time per iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| "
    r"learning rate: \d\.\d{6}E[+-]\d\d \| global batch size: +8 \| lm loss: (\d\.\d{6}E[+-]\d\d) \| "
    r"loss scale: 1\.0 \| grad norm: [\d.]+ \| number of skipped iterations: +0 \| "
    r"number of nan iterations: +0 \|$")


@pytest.fixture(scope="module")
def run_output(tmp_path_factory):
    tb = tmp_path_factory.mktemp("tb")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = torchrun(2, [os.path.join(ROOT, "pretrain_gpt.py")] + CMD.split() + ["--tensorboard-dir", str(tb)],
                 timeout=240, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, tb


def test_log_lines_and_loss_falls(run_output):
    out, _ = run_output
    matches = [LINE.match(l) for l in out.splitlines()]
    matches = [m for m in matches if m]
    assert [int(m.group(1)) for m in matches] == list(range(1, 21))
    assert [int(m.group(2)) for m in matches] == [8 * i for i in range(1, 21)]
    losses = [float(m.group(3)) for m in matches]
    assert losses[-1] < 0.8 * losses[0], losses  # ~6.24 -> ~4.6 at this lr


def test_startup_validation_and_milestones(run_output):
    out, tb = run_output
    for needle in ("------------------------ arguments ------------------------",
                   "[after megatron is initialized] datetime:", "> model: ", "tokens per iteration: 512",
                   "number of parameters on (tensor, pipeline) model parallel rank (0, 0):",
                   "Theoretical memory footprints: weight and optimizer=", "(min, max) time across ranks (ms):",
                   "[after training is done] datetime:"):
        assert needle in out, needle
    val = re.findall(r"^ validation loss at iteration 10 \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| $",
                     out, re.M)
    assert len(val) == 1 and math.isclose(float(val[0][1]), math.exp(float(val[0][0])), rel_tol=1e-5)
    assert re.search(r"^ validation loss at iteration 20 on validation set \| ", out, re.M)
    assert re.search(r"^ validation loss at iteration 20 on test set \| ", out, re.M)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))
