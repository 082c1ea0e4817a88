"""Fault drills on 2 CPU ranks (gloo) through the real pretrain_gpt.py: a fault, the run ends with a diagnosis,
the launcher (torchrun --max-restarts, or the test standing in for it) starts the same command again, it
resumes from the latest good checkpoint (--load = --save), and from the resumed iteration on its losses
(bitwise), consumed samples and data order (a hash of every micro-batch each rank read) equal an
uninterrupted run's. Faults are armed by tests/functional/fault_drill_driver.py (DRILL_FAULT) and the
checkpoint writer's test hook (MEGATRON_CKPT_FAULT); docs/fault_tolerance.md describes each case.
"""
import json
import os
import re
import time

import pytest

from megatron.core import dist_checkpointing
from tests.functional.cli_runner import ROOT, CliRunner
from tests.functional.fault_drill_driver import read_records
from tests.functional.torchrun import torchrun

DRIVER = "tests/functional/fault_drill_driver.py"
ITERS = 6
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-warmup-iters 2 --tokenizer-type NullTokenizer "
         f"--vocab-size 128 --eval-iters 0 --mock-data --log-interval 1 --num-workers 0 --train-iters {ITERS} "
         "--save-interval 2").split()
LOADED = re.compile(r"successfully loaded checkpoint from \S+ \[.*\] at iteration (\d+)")


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def _ckpt(tmp_path):
    d = str(tmp_path / "ckpt")
    return ["--save", d, "--load", d], d


def _run(cli, prefix, *flags, env=None, **kw):
    return cli.run([DRIVER] + FLAGS + [str(f) for f in flags], nranks=2, timeout=300,
                   env={"DRILL_RECORD": str(prefix), **(env or {})}, **kw)


@pytest.fixture(scope="module")
def reference(cli, tmp_path_factory):
    """The uninterrupted run: {rank: {iteration: (loss, consumed samples, micro-batch hashes)}}."""
    prefix = tmp_path_factory.mktemp("reference") / "rec"
    results = _run(cli, prefix)
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:] + results[1].err[-3000:]
    ref = {rank: {r["iteration"]: (r["loss"], r["consumed"], r["batches"]) for r in read_records(prefix, rank)}
           for rank in (0, 1)}
    assert sorted(ref[0]) == list(range(1, ITERS + 1)) and len({v[0] for v in ref[0].values()}) == ITERS
    assert ref[0][3][2] != ref[1][3][2]  # the two DP ranks read different data
    return ref


def _check_equal(reference, prefix):
    """Every step a run recorded equals the reference's: loss (bitwise), consumed samples, micro-batches."""
    for rank in (0, 1):
        for r in read_records(prefix, rank):
            assert (r["loss"], r["consumed"], r["batches"]) == reference[rank][r["iteration"]], (rank, r)


def _check_continues(reference, prefix, resumed, launch=None):
    """The records of the restarted launch: iterations resumed+1..ITERS, each equal to the reference's; and
    every step any launch recorded equals the reference's (saving and failing do not perturb training)."""
    _check_equal(reference, prefix)
    for rank in (0, 1):
        records = read_records(prefix, rank)
        last = [r for r in records if launch is None or r["launch"] == launch]
        assert [r["iteration"] for r in last] == list(range(resumed + 1, ITERS + 1)), (rank, last)


def _resumed(out):
    return int(LOADED.search(out).group(1))


def _previous_launch(out):
    return re.search(r"> previous launch \(started \S+\) ended: (.*)", out).group(1)


def test_sigkill_one_rank_torchrun_restarts_and_resumes(tmp_path, reference):
    """Rank 1 is SIGKILLed in iteration 5 (after its backward) with an --async-save in flight; torchrun
    (--max-restarts 1) restarts both ranks, which resume from the latest complete checkpoint."""
    load, d = _ckpt(tmp_path)
    prefix = tmp_path / "rec"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "DRILL_RECORD": str(prefix), "DRILL_FAULT": "sigkill:1:5"}
    p = torchrun(2, ["--max-restarts", "1", "--monitor-interval", "0.1", os.path.join(ROOT, DRIVER)] + FLAGS + load
                 + ["--async-save"], cwd=ROOT, env=env, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "launch 2 of this run (restart 1; launcher restart count 1)" in out, out[-5000:]
    previous = _previous_launch(out)
    assert previous.startswith("failed: "), previous
    assert "rank(s) 1 reported nothing" in previous or "no rank reported an error" in previous, previous
    resumed = _resumed(out)
    assert resumed in (2, 4)
    assert max(r["iteration"] for r in read_records(prefix, 1) if r["launch"] == 0) == 4  # killed in 5
    _check_continues(reference, prefix, resumed, launch=1)
    record = json.load(open(os.path.join(d, "launch_record.json")))
    assert [e["outcome"][:9] for e in record["launches"]] == ["failed: r" if "rank(s)" in previous else
                                                              "failed: n", "completed"]


def test_sigstop_hang_dumps_exits_and_restart_resumes(cli, tmp_path, reference):
    """Rank 1 freezes in iteration 3 for 10 s. Rank 0's watchdog dumps its stacks and collectives, its wait
    fails at the 4 s timeout and it exits; rank 1, thawed, finds its stall in its own dump, then fails on
    the departed peer and exits too. The restarted run resumes from iteration 2."""
    load, d = _ckpt(tmp_path)
    dumps = str(tmp_path / "hang_rank")
    hang = ["--distributed-timeout-seconds-after-init", "4", "--flight-recorder-dump-path", dumps]
    start = time.time()
    results = _run(cli, tmp_path / "first", *load, *hang, env={"DRILL_FAULT": "sigstop:1:3:10"})
    elapsed = time.time() - start
    assert results[0].rc == 1 and results[1].rc not in (0, "timeout"), results
    assert f"hang watchdog: after 4 s without progress each rank writes its stacks and last collectives to " \
           f"{dumps}<rank>.stacks.txt" in results[0].out  # the log names the files
    for rank, res in enumerate(results):
        path = f"{dumps}{rank}.stacks.txt"
        assert f"[rank {rank}] hang: " in res.err and path in res.err, res.err[-2000:]
        dump = open(path).read()
        assert "## last collectives of this rank" in dump and "## Python stacks of every thread" in dump
        assert re.search(r"#\d+ +(all_reduce|barrier|broadcast|all_gather) ", dump)
        assert re.search(r"\[rank %d\] \w+: " % rank, res.err)  # the failure, one line with its rank
    rank0, rank1 = open(f"{dumps}0.stacks.txt").read(), open(f"{dumps}1.stacks.txt").read()
    assert "WAITING for" in rank0 and "pretrain_gpt.py" in rank0  # rank 0 sat in a collective of a step
    stall = re.search(r"no progress for (\d+\.\d) s", rank1)
    assert stall and float(stall.group(1)) >= 3.6  # the frozen rank knows it stalled
    assert elapsed < 100
    results = _run(cli, tmp_path / "restart", *load, *hang)
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:]
    assert _resumed(results[0].out) == 2
    previous = _previous_launch(results[0].out)
    assert previous.startswith("failed: rank 0 in iteration 3: ") and f"(hang dump {dumps}0.stacks.txt)" in previous
    _check_continues(reference, tmp_path / "restart", 2)


def test_sigterm_saves_exits_zero_and_restart_resumes(cli, tmp_path, reference):
    """--exit-signal-handler: SIGTERM reaches rank 1 alone in iteration 3; every rank agrees at the end of
    the step, saves iteration 3 and exits 0. The restart resumes there."""
    load, d = _ckpt(tmp_path)
    results = _run(cli, tmp_path / "first", *load, "--exit-signal-handler", env={"DRILL_FAULT": "sigterm:1:3"})
    assert [r.rc for r in results] == [0, 0], results[1].err[-3000:]
    out = results[0].out
    assert "exiting program after receiving SIGTERM." in out
    assert "successfully saved checkpoint from iteration       3" in out
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read() == "3"
    assert os.path.isfile(os.path.join(d, "iter_0000003", "metadata.json"))
    results = _run(cli, tmp_path / "restart", *load, "--exit-signal-handler")
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:]
    assert _resumed(results[0].out) == 3
    assert _previous_launch(results[0].out) == "exited after receiving SIGTERM at iteration 3 (checkpoint saved)"
    _check_equal(reference, tmp_path / "first")  # the steps before the signal, too
    _check_continues(reference, tmp_path / "restart", 3)


def test_disk_full_during_save_keeps_previous_checkpoint(cli, tmp_path, reference):
    """The save of iteration 4 hits ENOSPC (MEGATRON_CKPT_FAULT=writing:enospc@4, after the shards were
    partly written): one line names the error and the checkpoint that stays the latest, the staging
    directory is removed, the tracker still says 2, and the restart resumes from 2."""
    load, d = _ckpt(tmp_path)
    results = _run(cli, tmp_path / "first", *load, env={"MEGATRON_CKPT_FAULT": "writing:enospc@4"})
    assert all(r.rc not in (0, "timeout") for r in results), results
    line = (f"CheckpointingException: saving the checkpoint of iteration 4 to {d} failed: [Errno 28] No space left "
            f"on device (injected by MEGATRON_CKPT_FAULT): '{d}/iter_0000004.tmp'; iteration 2 stays the latest "
            f"checkpoint")
    assert any(line in r.err for r in results), results[0].err[-2000:] + results[1].err[-2000:]
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read() == "2"
    assert not [n for n in os.listdir(d) if n.startswith("iter_0000004")], os.listdir(d)
    results = _run(cli, tmp_path / "restart", *load)
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:]
    assert _resumed(results[0].out) == 2
    assert "No space left on device" in _previous_launch(results[0].out)
    _check_continues(reference, tmp_path / "restart", 2)


def test_corrupt_shard_named_at_load_and_fallback_resumes(cli, tmp_path, reference):
    """Bytes inside a tensor of rank 1's shard of the latest checkpoint change (silent corruption that
    only the --verify-integrity hashes catch). Loading names the file and suggests the fallback;
    --ckpt-fallback-to-previous loads iteration 2 and the run continues as if uninterrupted."""
    load, d = _ckpt(tmp_path)
    results = _run(cli, tmp_path / "first", *load, "--verify-integrity", "--exit-interval", "4")
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:]
    shard = os.path.join(d, "iter_0000004", "__1_0.distcp")
    with open(shard, "r+b") as f:  # the middle of the file: tensor bytes, which torch.load would not check
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\x7f" * 16)
    results = _run(cli, tmp_path / "refused", *load, "--verify-integrity")
    assert [r.rc for r in results] == [2, 2], results[0].err[-3000:]
    assert (f"[rank 0] CheckpointingException: checkpoint integrity check failed in {d}/iter_0000004: "
            f"__1_0.distcp (hash mismatch); pass --ckpt-fallback-to-previous to load iteration 2 instead"
            in results[0].err), results[0].err[-2000:]
    results = _run(cli, tmp_path / "restart", *load, "--verify-integrity", "--ckpt-fallback-to-previous")
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:]
    assert "WARNING: the checkpoint of iteration 4 cannot be loaded (checkpoint integrity check failed" in \
        results[0].out and "--ckpt-fallback-to-previous: loading iteration 2 instead" in results[0].out
    assert _resumed(results[0].out) == 2
    _check_continues(reference, tmp_path / "restart", 2)


def test_nan_from_a_bad_batch_stops_with_a_checkpoint_and_restart_resumes(cli, tmp_path, reference):
    """A NaN injected into the loss of iteration 3 (once: a transient fault) is re-run; the rerun state
    machine's verdict is logged, the state before that step is saved and the run exits 17. The restart
    (without the injection) resumes from iteration 2."""
    load, d = _ckpt(tmp_path)
    tracker = tmp_path / "rejected.txt"
    # With one micro-batch and one gradient bucket a step validates 4 results (NaN and Inf checks of the loss,
    # then of the bucket's gradients): rate 9 hits step 3's loss NaN check.
    inject = ["--error-injection-rate", "9", "--error-injection-type", "transient_error",
              "--result-rejected-tracker-filename", tracker]
    results = _run(cli, tmp_path / "first", *load, *inject)
    assert [r.rc for r in results] == [17, 17], results[0].err[-3000:]
    assert re.search(r"rerun: rank 0 iteration 3: found NaN in local forward loss calculation: result nan, "
                     r"re-run [\d.]+ -> transient_error; stopping the run", results[0].out), results[0].out[-3000:]
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read() == "2"
    assert "iteration=3 rank=0" in tracker.read_text() and "decision=stop" in tracker.read_text()
    common = dist_checkpointing.load_common_state_dict(os.path.join(d, "iter_0000002"))
    [decision] = common["rerun_state_machine"]["decisions"]
    assert (decision["iteration"], decision["diagnosis"], decision["decision"]) == (3, "transient_error", "stop")
    results = _run(cli, tmp_path / "restart", *load)
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:]
    assert _resumed(results[0].out) == 2
    assert _previous_launch(results[0].out).startswith(
        "stopped by the rerun state machine: result validation failed at iteration 3 (exit code 17")
    _check_continues(reference, tmp_path / "restart", 2)
