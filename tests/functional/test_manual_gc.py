"""--manual-gc and the collector freeze around the training loop: the collector's state inside and after
the loop, the collection schedule, and the real CLI giving the identical loss with and without the flag."""
import gc
import re

import pytest

from megatron.training import gc_control
from tests.functional.cli_runner import CliRunner


class _Args:
    def __init__(self, manual_gc=False, manual_gc_interval=0, manual_gc_eval=True):
        self.manual_gc, self.manual_gc_interval, self.manual_gc_eval = manual_gc, manual_gc_interval, manual_gc_eval


def test_freeze_during_the_loop_and_restore_after():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    junk = [[]]
    junk[0].append(junk)  # a cycle alive before the loop: frozen with everything else, not leaked after
    with gc_control.training_gc(_Args()):
        assert gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with gc_control.training_gc(_Args(manual_gc=True)):
            assert not gc.isenabled()
            raise RuntimeError("a failing step")
    assert gc.isenabled() and gc.get_freeze_count() == 0  # restored on the error path too


def test_manual_schedule(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    args = _Args(manual_gc=True, manual_gc_interval=3)
    for it in range(1, 10):
        gc_control.after_iteration(args, it)
    assert calls == [2, 2, 2]  # iterations 3, 6, 9
    calls.clear()
    gc_control.around_evaluation(args)
    gc_control.around_evaluation(args, generation=0)
    gc_control.around_evaluation(_Args(manual_gc=True, manual_gc_eval=False))
    gc_control.after_iteration(_Args(manual_gc=False, manual_gc_interval=1), 1)
    gc_control.after_iteration(_Args(manual_gc=True, manual_gc_interval=0), 4)
    assert calls == [2, 0]


def test_cli_manual_gc_same_losses():
    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 6 --lr 1e-3 --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 128 --eval-interval 3 --eval-iters 1 "
             "--log-interval 1").split()
    losses = []
    with CliRunner() as cli:
        for extra in ([], ["--manual-gc", "--manual-gc-interval", "2"]):
            (res,) = cli.run(["pretrain_gpt.py"] + flags + extra, timeout=120)
            assert res.rc == 0, res.err[-2000:]
            losses.append(re.findall(r"lm loss: ([\d.E+-]+)", res.out))
    assert len(losses[0]) >= 6 and losses[0] == losses[1]
