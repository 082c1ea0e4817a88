"""Run pretrain_gpt.py as `__main__` with a fault armed and every training step recorded (the fault drills:
tests/functional/test_fault_drills.py on CPU, tests/gpu/test_fault_drills_gpu.py on GPUs).

    [torchrun ...] python tests/functional/fault_drill_driver.py <pretrain_gpt.py flags>

DRILL_RECORD=<prefix>: each rank appends one JSON line per training step to `<prefix>.rank<R>`: the launch
(torchrun's restart count), the iteration, the loss (`float.hex`, exact), the samples consumed before the
step and a hash of the tokens of every micro-batch this rank read for it (the data order).
DRILL_FAULT=<kind>:<rank>:<iteration>[:<seconds>] fires on that rank in that iteration, after its forward and
backward and before the optimizer step, in the first launch only:
  sigkill  the rank kills itself (a GPU falls off the bus, a node dies)
  sigterm  the rank gets SIGTERM (a preemption notice; with --exit-signal-handler the run saves and exits)
  sigstop  the rank freezes for <seconds> (a hang), then goes on
"""
import hashlib
import json
import os
import runpy
import signal
import subprocess
import sys

import megatron.training.training as training
from megatron.training.global_vars import get_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BATCHES = []


def _rank():
    return int(os.environ.get("RANK", "0"))


def _launch():
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class _RecordingIterator:
    """The train iterator, hashing the tokens of every micro-batch it hands out."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        tokens = batch["tokens"] if isinstance(batch, dict) else batch[0]
        _BATCHES.append(hashlib.sha1(tokens.cpu().numpy().tobytes()).hexdigest()[:16])
        return batch

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _fire(kind, seconds):
    sys.stdout.flush()
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "sigstop":  # a shell wakes this process up again after `seconds`
        subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"DRILL_FAULT: unknown fault {kind!r}; use sigkill, sigterm or sigstop")


def _arm():
    spec = os.environ.get("DRILL_FAULT")
    if not spec or _launch() != 0:
        return
    kind, rank, iteration, *rest = spec.split(":")
    if int(rank) != _rank():
        return
    make = training.get_training_forward_backward_func

    def make_faulty():
        forward_backward = make()

        def faulty(*a, **kw):
            out = forward_backward(*a, **kw)
            if get_args().iteration + 1 == int(iteration):
                _fire(kind, float(rest[0]) if rest else 0.0)
            return out
        return faulty

    training.get_training_forward_backward_func = make_faulty


def _record():
    prefix = os.environ.get("DRILL_RECORD")
    if not prefix:
        return
    build, step = training.build_iterators_for_model_chunks, training.train_step

    def build_recording(*a, **kw):
        train_it, valid_it, test_it = build(*a, **kw)
        return (_RecordingIterator(train_it) if train_it is not None else None), valid_it, test_it

    def step_recording(*a, **kw):
        args = get_args()
        iteration, consumed = args.iteration + 1, args.consumed_train_samples
        _BATCHES.clear()
        result = step(*a, **kw)
        loss = result[0].get("lm loss") if result[0] else None
        line = {"launch": _launch(), "iteration": iteration, "consumed": consumed, "batches": list(_BATCHES),
                "loss": float(loss).hex() if loss is not None else None}
        with open(f"{prefix}.rank{_rank()}", "a") as f:
            f.write(json.dumps(line) + "\n")
        return result

    training.build_iterators_for_model_chunks = build_recording
    training.train_step = step_recording


def read_records(prefix, rank):
    """The JSON lines a run recorded for ``rank`` (empty when it recorded none)."""
    path = f"{prefix}.rank{rank}"
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    _record()
    _arm()
    sys.argv = [os.path.join(ROOT, "pretrain_gpt.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
