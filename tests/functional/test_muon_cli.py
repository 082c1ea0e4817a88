"""`pretrain_gpt.py --optimizer muon` / `dist_muon` as a user runs it (2 ranks with torchrun's environment,
forked from one module CliRunner; mock data): the loss falls, the log shows the optimizer's timers, and bad
combinations stop with one line naming the flag."""
import re

import pytest

from tests.functional.cli_runner import CliRunner

CMD = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
       "--position-embedding-type rope --micro-batch-size 2 --global-batch-size 8 --train-iters 15 --lr 1e-2 "
       "--lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 "
       "--eval-iters 0 --num-workers 0 --timing-log-level 1")
LOSS = re.compile(r"iteration +(\d+)/ +15 \|.* lm loss: (\S+) \|")


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:  # one server (torch and pretrain_gpt imported once) for every run of the module
        yield runner


@pytest.mark.parametrize("optimizer", ["muon", "dist_muon"])
def test_loss_falls_and_timers_logged(cli, optimizer):
    results = cli.run(["pretrain_gpt.py"] + CMD.split() + ["--optimizer", optimizer], nranks=2, timeout=300)
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:] + results[1].err[-3000:]
    out = results[-1].out  # the last rank prints the iteration lines and the timers
    losses = [float(m.group(2)) for m in LOSS.finditer(out)]
    assert len(losses) == 15 and losses[-1] < 0.8 * losses[0], losses
    for timer in ("optimizer-inner-step", "optimizer-clip-main-grad", "optimizer "):
        assert re.search(rf"^ +{timer}.*: \(", out, re.M), timer
    if optimizer == "dist_muon":
        assert re.search(r"^ +params-all-gather.*: \(", out, re.M)


@pytest.mark.parametrize("extra,needle", [
    ("--optimizer soap", "--optimizer soap is not supported; use adam, sgd, lion, muon, dist_muon"),
    ("--optimizer muon --fp16", "--optimizer muon does not support --fp16"),
    ("--optimizer muon --use-torch-fsdp2", "--optimizer muon does not support --use-torch-fsdp2"),
    ("--optimizer dist_muon --ckpt-format torch", "saves with --ckpt-format torch_dist"),
    ("--optimizer muon --muon-fp32-matmul-prec low", "--muon-fp32-matmul-prec low is not supported"),
    ("--optimizer muon --muon-coefficient-type custom", "--muon-coefficient-type custom: use one of"),
])
def test_bad_combination_one_line(cli, extra, needle):
    (run,) = cli.run(["pretrain_gpt.py"] + CMD.split() + extra.split(), nranks=1, timeout=120)
    assert run.rc != 0
    lines = [line for line in (run.out + run.err).splitlines() if needle in line]
    assert lines, run.err[-2000:]
