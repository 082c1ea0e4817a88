"""`pretrain_gpt.py --optimizer muon` / `dist_muon` as a user runs it (torchrun, 2 ranks, mock data): the
loss falls, the log shows the optimizer's timers, and bad combinations stop with one line naming the flag."""
import os
import re

import pytest

from tests.functional.cli_runner import CliRunner
from tests.functional.torchrun import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CMD = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
       "--position-embedding-type rope --micro-batch-size 2 --global-batch-size 8 --train-iters 15 --lr 1e-2 "
       "--lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 "
       "--eval-iters 0 --num-workers 0 --timing-log-level 1")
LOSS = re.compile(r"iteration +(\d+)/ +15 \|.* lm loss: (\S+) \|")


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:  # one server (torch and pretrain_gpt imported once) for every refused combination
        yield runner


@pytest.mark.parametrize("optimizer", ["muon", "dist_muon"])
def test_loss_falls_and_timers_logged(optimizer):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = torchrun(2, [os.path.join(ROOT, "pretrain_gpt.py")] + CMD.split() + ["--optimizer", optimizer],
                 timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = [float(m.group(2)) for m in LOSS.finditer(p.stdout)]
    assert len(losses) == 15 and losses[-1] < 0.8 * losses[0], losses
    for timer in ("optimizer-inner-step", "optimizer-clip-main-grad", "optimizer "):
        assert re.search(rf"^ +{timer}.*: \(", p.stdout, re.M), timer
    if optimizer == "dist_muon":
        assert re.search(r"^ +params-all-gather.*: \(", p.stdout, re.M)


@pytest.mark.parametrize("extra,needle", [
    ("--optimizer lion", "--optimizer lion is not supported; use adam, sgd, muon, dist_muon"),
    ("--optimizer muon --fp16", "--optimizer muon does not support --fp16"),
    ("--optimizer muon --use-torch-fsdp2", "--optimizer muon does not support --use-torch-fsdp2"),
    ("--optimizer dist_muon --ckpt-format torch", "saves with --ckpt-format torch_dist"),
    ("--optimizer muon --muon-scalar-optimizer lion", "--muon-scalar-optimizer lion is not supported"),
    ("--optimizer muon --muon-fp32-matmul-prec low", "--muon-fp32-matmul-prec low is not supported"),
    ("--optimizer muon --muon-coefficient-type custom", "--muon-coefficient-type custom: use one of"),
])
def test_bad_combination_one_line(cli, extra, needle):
    (run,) = cli.run(["pretrain_gpt.py"] + CMD.split() + extra.split(), nranks=1, timeout=120)
    assert run.rc != 0
    lines = [line for line in (run.out + run.err).splitlines() if needle in line]
    assert lines, run.err[-2000:]
