"""Hang dump and straggler report on 2 CPU ranks (gloo) through the real pretrain_gpt.py."""
import re
import time

import pytest

from tests.functional.cli_runner import CliRunner

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 128 --eval-iters 0 "
         "--mock-data").split()


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def test_hang_dumps_every_rank_and_ends_at_the_timeout(cli, tmp_path):
    """Rank 1 freezes (SIGSTOP) for 10 s once it logged iteration 1, so it reaches no collective; rank 0
    waits for it in one. Rank 0's watchdog writes its dump, its wait fails at the 4 s timeout and it exits;
    rank 1, thawed, finds its stall in its own dump, then fails on the departed peer and exits too."""
    prefix = str(tmp_path / "hang_rank")
    start = time.time()
    results = cli.run(["pretrain_gpt.py"] + MODEL + ["--train-iters", "50", "--log-interval", "1",
                                                      "--distributed-timeout-seconds-after-init", "4",
                                                      "--flight-recorder-dump-path", prefix],
                      nranks=2, timeout=120, pause=dict(rank=1, when_rank=1, when_text="iteration        1/",
                                                         for_s=10))
    elapsed = time.time() - start
    assert results[0].rc == 1 and results[1].rc not in (0, "timeout"), results
    assert f"hang watchdog: after 4 s without progress each rank writes its stacks and last collectives to " \
           f"{prefix}<rank>.stacks.txt" in results[0].out  # the log names the files
    for rank, res in enumerate(results):
        path = f"{prefix}{rank}.stacks.txt"
        assert f"[rank {rank}] hang: " in res.err and path in res.err, res.err[-2000:]
        dump = open(path).read()
        assert "## last collectives of this rank" in dump and "## Python stacks of every thread" in dump
        assert re.search(r"#\d+ +(all_reduce|barrier|broadcast|all_gather) ", dump)
        assert re.search(r"\[rank %d\] \w+: " % rank, res.err)  # the failure, one line with its rank
    rank0, rank1 = open(f"{prefix}0.stacks.txt").read(), open(f"{prefix}1.stacks.txt").read()
    assert "WAITING for" in rank0 and "pretrain_gpt.py" in rank0  # rank 0 sat in a collective of a step
    assert re.search(r"no progress for (\d+\.\d) s", rank1) and float(
        re.search(r"no progress for (\d+\.\d) s", rank1).group(1)) >= 3.6  # the frozen rank knows it stalled
    assert elapsed < 100


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
