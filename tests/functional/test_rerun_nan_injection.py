"""The rerun engine through pretrain_gpt.py: a NaN injected into the loss of one step (a real NaN: the
backward sees it) is re-run; injected again on the re-run it reproduces (the step is skipped and training
goes on with finite losses). Injected once it is a transient fault (stop, checkpoint, exit 17, restart): a
fault drill in tests/functional/test_fault_drills.py."""
import re

import pytest

from megatron.core import dist_checkpointing
from tests.functional.cli_runner import CliRunner

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 128 --eval-iters 0 "
         "--mock-data --log-interval 1").split()
# With one micro-batch and one gradient bucket a step validates 4 results (the NaN and Inf checks of the
# loss, then of the bucket's gradients, as Megatron counts them): rate 9 hits the NaN check of step 3's loss
# and no other within 4 steps.
INJECT = ["--error-injection-rate", "9", "--train-iters", "4"]


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def _losses(out):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"iteration +(\d+)/ +\d+ \|.*?lm loss: (\S+) \|", out)}


def test_reproducible_nan_skips_the_step(cli, tmp_path):
    res = cli.run(["pretrain_gpt.py"] + MODEL + INJECT + [
        "--error-injection-type", "persistent_error", "--save", tmp_path / "ckpt", "--save-interval", "4"],
        timeout=120)[0]
    assert res.rc == 0, res.err[-3000:]
    assert re.search(r"rerun: rank 0 iteration 3: found NaN in local forward loss calculation: result nan, "
                     r"re-run nan -> persistent_error; skipping the step", res.out), res.out[-3000:]
    line3 = next(l for l in res.out.splitlines() if re.search(r"iteration +3/", l))
    assert "number of skipped iterations:   1" in line3
    losses = _losses(res.out)
    assert float(losses[4]) == float(losses[4])  # finite: the NaN gradients of step 3 never reached the weights
    common = dist_checkpointing.load_common_state_dict(str(tmp_path / "ckpt" / "iter_0000004"))
    [decision] = common["rerun_state_machine"]["decisions"]
    assert (decision["iteration"], decision["diagnosis"], decision["decision"]) == (3, "persistent_error", "skip")


def test_disabled_mode_stops_at_the_nan(cli):
    res = cli.run(["pretrain_gpt.py"] + MODEL + INJECT + ["--rerun-mode", "disabled"], timeout=120)[0]
    assert res.rc == 1
    assert re.search(r"\[rank 0\] RuntimeError: Rank 0, node \S+, iteration 3: unexpected result nan "
                     r"\(found NaN in local forward loss calculation\)", res.err), res.err[-2000:]


def test_report_stats_reruns_every_step(cli):
    """CPU fp32 is deterministic: every re-run reproduces its step exactly."""
    res = cli.run(["pretrain_gpt.py"] + MODEL + ["--train-iters", "2", "--rerun-mode", "report_stats",
                                                  "--check-for-large-grads"], timeout=120)[0]
    assert res.rc == 0, res.err[-3000:]
    stats = re.search(r"rerun stats \(rank 0, iteration 2\): (.*)", res.out).group(1)
    assert "found NaN in local forward loss calculation: max relative difference 0 over 2 re-runs" in stats
    assert "unexpectedly large grad norm: max relative difference 0 over 2 re-runs" in stats
