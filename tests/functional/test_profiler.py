"""--profile --use-pytorch-profiler through the real CLI on 2 gloo ranks: each rank of --profile-ranks writes
a Chrome trace of exactly the window's iterations, with the step's forward, backward and optimizer ranges
named in it; a rank outside --profile-ranks writes none; the losses equal an unprofiled run's; and the flags
that cannot work on this machine are refused with one line naming the flag."""
import glob
import json
import re

import pytest

from tests.functional.cli_runner import CliRunner
from tools.trace_report import analyse

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 4 --train-iters 5 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-iters 0").split()


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def _names(trace_path):
    events = json.load(open(trace_path))["traceEvents"]
    return {e.get("name") for e in events}


def test_pytorch_profiler_traces_the_window_on_the_chosen_ranks(cli, tmp_path):
    window = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3",
              "--tensorboard-dir", str(tmp_path / "tb")]
    plain = cli.run(["pretrain_gpt.py", *FLAGS], nranks=2, timeout=300)
    profiled = cli.run(["pretrain_gpt.py", *FLAGS, *window, "--profile-ranks", "1"], nranks=2, timeout=300)
    for res in plain + profiled:
        assert res.rc == 0, res.err[-3000:]
    loss = re.compile(r"lm loss: ([\d.E+-]+)")
    assert loss.findall(plain[-1].out) == loss.findall(profiled[-1].out)  # profiling changes nothing
    traces = glob.glob(str(tmp_path / "tb" / "*.pt.trace.json"))
    assert [p.split("/")[-1].split(".")[0] for p in traces] == ["rank1"]
    names = _names(traces[0])
    assert {"forward", "backward", "optimizer"} <= names
    steps = [e for e in json.load(open(traces[0]))["traceEvents"] if e.get("name") == "optimizer"]
    assert len(steps) == 2  # iterations 1 and 2 of 0..4: the window [1, 3)
    assert "profiler trace of iterations 1-3 written" in profiled[1].out
    report = analyse(json.load(open(traces[0]))["traceEvents"])  # tools/trace_report.py reads it
    assert report["ranges"]["optimizer"]["count"] == 2 and report["ranges"]["forward"]["count"] >= 2
    assert 0 < report["ranges"]["forward"]["ms"] < report["wall_ms"]


def test_flags_that_cannot_work_here_are_refused_in_one_line(cli):
    cases = {
        "--use-pytorch-profiler writes its traces under --tensorboard-dir": ["--profile", "--use-pytorch-profiler"],
        "--use-pytorch-profiler needs --profile": ["--use-pytorch-profiler", "--tensorboard-dir", "/tmp/x"],
        "--record-memory-history records CUDA allocations": ["--record-memory-history"],
        "--profile-step-start (5) must be": ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "/tmp/x",
                                             "--profile-step-start", "5", "--profile-step-end", "5"],
    }
    for message, extra in cases.items():
        (res,) = cli.run(["pretrain_gpt.py", *FLAGS, *extra], timeout=120)
        assert res.rc != 0 and message in res.out + res.err, (extra, res.out[-1500:], res.err[-1500:])
