"""`pretrain_gpt.py --qk-clip --log-max-attention-logit` on 2 ranks (TP=2, mock data; the ranks forked by one
CliRunner server with torchrun's environment): each log line carries the max attention logit, TensorBoard gets
Megatron's `max_attention_logit` scalar, clipping holds the logit below the unclipped run's, and bad values stop
with one line naming the flag."""
import os
import re

import pytest

from tests.functional.cli_runner import CliRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 8
CMD = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
       "--seq-length 64 --max-position-embeddings 64 --position-embedding-type rope --micro-batch-size 2 "
       f"--global-batch-size 4 --train-iters {ITERS} --lr 1e-2 --lr-warmup-iters 2 --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 --eval-iters 0 --num-workers 0 "
       "--tensor-model-parallel-size 2 --log-max-attention-logit")
LOGIT = re.compile(r"iteration +(\d+)/ +\d+ \|.* max attention logit: (\S+) \|")


def _run(cli, tb_dir, extra):
    results = cli.run(["pretrain_gpt.py"] + CMD.split() + ["--tensorboard-dir", str(tb_dir)] + extra.split(),
                      nranks=2, timeout=300)
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:] + results[1].err[-3000:]
    stdout = "".join(r.out for r in results)
    logits = [float(m.group(2)) for m in LOGIT.finditer(stdout)]
    assert len(logits) == ITERS, stdout[-3000:]
    return logits, _tensorboard(str(tb_dir))


def _tensorboard(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(tb_dir)
    acc.Reload()
    events = sorted(acc.Scalars("max_attention_logit"), key=lambda e: e.step)
    assert [e.step for e in events] == list(range(1, ITERS + 1))
    return [e.value for e in events]


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:  # one server (torch and pretrain_gpt imported once) for every run
        yield runner


@pytest.fixture(scope="module")
def runs(cli, tmp_path_factory):
    return {"log": _run(cli, tmp_path_factory.mktemp("log"), ""),
            "clip": _run(cli, tmp_path_factory.mktemp("clip"), "--qk-clip --qk-clip-threshold 0.1")}


def test_log_line_and_tensorboard_agree(runs):
    for line, tb in runs.values():
        assert line == pytest.approx(tb, abs=1e-3)  # the line prints 3 decimals


def test_clip_holds_the_logit(runs):
    logged, clipped = runs["log"][1], runs["clip"][1]
    assert logged[0] == pytest.approx(clipped[0], rel=1e-5)  # the first forward precedes any clip
    # Each step's clip pulls the logit down (Adam at lr 1e-2 pushes it back up within the step).
    assert all(c < u for c, u in zip(clipped[1:], logged[1:])), (logged, clipped)
    assert sum(clipped[1:]) < 0.85 * sum(logged[1:]), (logged, clipped)


@pytest.mark.parametrize("extra,needle", [
    ("--qk-clip --qk-clip-alpha 1.0", "--qk-clip-alpha must be between 0.0 and 1.0"),
    ("--qk-clip --qk-clip-threshold 0", "--qk-clip-threshold must be greater than 0"),
    ("--qk-clip --use-torch-fsdp2", "--qk-clip does not support --use-torch-fsdp2"),
])
def test_bad_values_one_line(cli, extra, needle):
    (run,) = cli.run(["pretrain_gpt.py"] + CMD.replace("--tensor-model-parallel-size 2", "").split()
                     + extra.split(), nranks=1, timeout=120)
    assert run.rc != 0
    assert [line for line in (run.out + run.err).splitlines() if needle in line], run.err[-2000:]
