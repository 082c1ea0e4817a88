"""Exact resume through the real CLI: a run that saves at iteration 3 and a run that restarts from that
checkpoint print the same `lm loss` text as one uninterrupted run (dropout on, so RNG state matters).

Single process for torch_dist and torch (saved by --exit-interval), and DP=2 with --async-save, each run
forked from one CliRunner server that imported torch once (ranks get torchrun's environment)
(single-process async resume is covered in tests/unit/training/checkpointing/test_checkpointing.py).
SIGTERM with --exit-signal-handler (save, exit 0, resume) is a fault drill: tests/functional/test_fault_drills.py.
"""
import os
import re

import pytest

from tests.functional.cli_runner import CliRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 6
CMD = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
       "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --lr-warmup-iters 2 --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-interval 100 --eval-iters 0 "
       "--num-workers 0 --save-interval 3").split()
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\S+) \|")


ARCH = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def run(cli, *extra, nproc=1, iters=ITERS, base=CMD):
    """Run pretrain_gpt.py on ``nproc`` ranks; return (the ranks' stdout, {iteration: loss text})."""
    runs = cli.run(["pretrain_gpt.py"] + base + ["--train-iters", str(iters)] + list(extra), nranks=nproc,
                   timeout=300, stop_others=True)
    assert all(r.rc == 0 for r in runs), "".join(r.out[-3000:] + r.err[-3000:] for r in runs)
    out = "".join(r.out for r in runs)  # rank 0 reports the checkpoints, the last rank the losses
    return out, {int(m.group(1)): m.group(2) for m in LOSS.finditer(out)}


@pytest.fixture(scope="module")
def straight(cli):
    return run(cli)[1]


def _check_resume(ref, saved, resumed, tag):
    assert sorted(ref) == list(range(1, ITERS + 1)), (tag, ref)
    assert {k: v for k, v in saved.items() if k <= 3} == {k: ref[k] for k in (1, 2, 3)}, (tag, saved, ref)
    assert resumed == {k: ref[k] for k in range(4, ITERS + 1)}, (tag, resumed, ref)


def test_resume_torch_dist(cli, tmp_path, straight):
    d = str(tmp_path / "c")
    out, saved = run(cli, "--save", d)
    assert saved == straight  # saving does not perturb training
    assert "successfully saved checkpoint from iteration       3 to" in out
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read() == "6"
    # --use-checkpoint-args: the architecture flags come from the checkpoint.
    no_arch = [a for i, a in enumerate(CMD) if a not in ARCH[::2] and (i == 0 or CMD[i - 1] not in ARCH[::2])]
    out, resumed = run(cli, "--load", d, "--ckpt-step", "3", "--use-checkpoint-args", base=no_arch)
    assert f"loading checkpoint from {d} at iteration 3" in out
    assert re.search(r"^  num_layers \.+ 2$", out, re.M) and re.search(r"^  hidden_size \.+ 32$", out, re.M)
    _check_resume(straight, saved, resumed, "torch_dist")


def test_resume_torch_format_after_exit_interval(cli, tmp_path, straight):
    d = str(tmp_path / "c")
    out, saved = run(cli, "--save", d, "--ckpt-format", "torch", "--exit-interval", "3", "--save-interval", "100")
    assert "exiting program at iteration 3" in out and sorted(saved) == [1, 2, 3]
    assert os.path.isfile(os.path.join(d, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    _, resumed = run(cli, "--load", d, "--ckpt-format", "torch")
    _check_resume(straight, saved, resumed, "torch")


def test_resume_dp2_async_save(cli, tmp_path):
    """DP=2 with the distributed optimizer: each rank writes its own optimizer range and half the weights (the
    default fully parallel save); resumed with a plain load and with --ckpt-fully-parallel-load."""
    d = str(tmp_path / "c")
    _, saved = run(cli, "--save", d, "--async-save", "--use-distributed-optimizer", nproc=2)
    assert sorted(os.listdir(d)) == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt",
                                     "launch_record.json"]
    assert {"__0_0.distcp", "__1_0.distcp", "metadata.json"} <= set(os.listdir(os.path.join(d, "iter_0000003")))
    _, resumed = run(cli, "--load", d, "--ckpt-step", "3", "--use-distributed-optimizer", nproc=2)
    _check_resume(saved, saved, resumed, "dp2")
    _, resumed = run(cli, "--load", d, "--ckpt-step", "3", "--use-distributed-optimizer", "--ckpt-fully-parallel-load",
                     nproc=2)
    _check_resume(saved, saved, resumed, "dp2 fully parallel load")
