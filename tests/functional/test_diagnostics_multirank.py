"""Straggler report on 2 CPU ranks (gloo) through the real pretrain_gpt.py (the hang dump is a fault drill:
tests/functional/test_fault_drills.py)."""
import re

import pytest

from tests.functional.cli_runner import CliRunner

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 128 --eval-iters 0 "
         "--mock-data").split()


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def test_straggler_report_names_the_slow_rank(cli):
    """Rank 1 runs 40 ms out of every 120 ms (SIGSTOP/SIGCONT from the launcher): its own step time is ~3x
    rank 0's, which waits for it in the gradient all-reduce. Each report covers 20 steps, at least 170 ms
    even at 9 ms a step, so it spans a whole 120 ms cycle of rank 1 (6 steps were too few once a step took
    9 ms: a window could miss the stop)."""
    results = cli.run(["pretrain_gpt.py"] + MODEL + ["--train-iters", "40", "--log-interval", "20",
                                                      "--log-straggler", "--straggler-ctrlr-port", "0"],
                      nranks=2, timeout=120, throttle=dict(rank=1, run_ms=40, stop_ms=80))
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:] + results[1].err[-3000:]
    lines = [l for l in results[0].out.splitlines() if l.startswith("straggler report")]
    assert [re.search(r"iteration (\d+)", l).group(1) for l in lines] == ["20", "40"]
    for line in lines:
        slow, fast = re.search(r"slowest: rank (\d) ([\d.]+) \| fastest: rank (\d) ([\d.]+)", line).group(1, 3)
        assert (slow, fast) == ("1", "0"), line
    assert not any(l.startswith("straggler report") for l in results[1].out.splitlines())  # rank 0 reports


def test_straggler_report_off_at_startup(cli):
    results = cli.run(["pretrain_gpt.py"] + MODEL + ["--train-iters", "2", "--log-interval", "1", "--log-straggler",
                                                      "--disable-straggler-on-startup", "--straggler-ctrlr-port", "0"],
                      nranks=2, timeout=120)
    assert [r.rc for r in results] == [0, 0]
    assert "> straggler report off; toggle it with curl http://" in results[0].out
    assert "straggler report at iteration" not in results[0].out
