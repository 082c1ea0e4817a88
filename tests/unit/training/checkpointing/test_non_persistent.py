"""--non-persistent-save-interval with --non-persistent-ckpt-type global through pretrain(): non-persistent saves go
to <save>/non_persistent (or --non-persistent-global-ckpt-dir), only the newest is kept, and a run killed after one
resumes from it when it is newer than the last --save-interval checkpoint, continuing exactly as the run that was
not interrupted (the same losses)."""
import os

import pytest

from tests.fixtures.tiny_gpt import run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-3 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 --global-batch-size 4 --micro-batch-size 2")


class Killed(Exception):
    pass


def _losses(flags, kill_in=None):
    """Per-iteration losses of a run (killed by an exception in iteration ``kill_in``, after its step and before
    its checkpoint)."""
    losses, steps = [], []

    def on_step(model, optimizer, result):
        steps.append(1)
        losses.append(float(result[0]["lm loss"]))
        if kill_in is not None and len(steps) == kill_in:
            raise Killed()
    try:
        run_pretrain(flags.split(), on_step=on_step)
    except Killed:
        pass
    return losses


def _jobs(tmp):
    ckpt, np_dir = f"{tmp}/ckpt", f"{tmp}/ckpt/non_persistent"
    saving = (f"{MODEL} --save {ckpt} --load {ckpt} --save-interval 2 --non-persistent-save-interval 1 "
              f"--non-persistent-ckpt-type global")
    reference = _losses(f"{MODEL} --train-iters 6")
    first = _losses(f"{saving} --train-iters 6", kill_in=4)  # killed after the save of iteration 3
    kept = sorted(os.listdir(np_dir))
    persistent = open(f"{ckpt}/latest_checkpointed_iteration.txt").read()
    resumed = _losses(f"{saving} --train-iters 6")
    return reference, first, kept, persistent, resumed


def test_the_newest_non_persistent_save_is_kept_and_resumed_from(tmp_path):
    reference, first, kept, persistent, resumed = run_distributed(_jobs, 1, str(tmp_path))[0]
    assert persistent == "2" and kept == ["iter_0000003", "latest_checkpointed_iteration.txt"], kept
    assert first == reference[:4]
    assert len(resumed) == 3 and resumed == reference[3:], (resumed, reference)


@pytest.mark.parametrize("extra,needle", [
    ("--non-persistent-save-interval 2", "needs --non-persistent-ckpt-type global"),
    ("--non-persistent-save-interval 2 --non-persistent-ckpt-type local", "local and in_memory checkpoints need"),
])
def test_bad_flags_one_line(extra, needle):
    from megatron.training.arguments import ArgumentError, parse_args, validate_args
    with pytest.raises(ArgumentError, match=needle):
        validate_args(parse_args(argv=(MODEL + " --train-iters 2 --save /tmp/x " + extra).split()))
