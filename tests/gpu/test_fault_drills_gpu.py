"""Fault drills on two GPUs (NCCL, bf16, --deterministic-mode, dropout on), the GPU side of
tests/functional/test_fault_drills.py:

- SIGKILL: rank 1 kills itself in iteration 5 (after its backward) under `torchrun --max-restarts 1` with an
  --async-save in flight; torchrun stops rank 0 (waiting in NCCL) and restarts both ranks, which resume
  from the latest complete checkpoint.
- SIGSTOP: rank 1 freezes in iteration 3 for 40 s. Rank 0's watchdog writes its stacks and collectives at
  90% of the 20 s timeout and NCCL's watchdog ends it at the timeout (torch's flight recorder writes its
  trace); rank 1, thawed, writes its own stall and ends on its NCCL timeout. The same command again resumes.

After each, the restarted run's losses (bitwise: deterministic mode), consumed samples and micro-batches
(hashes) equal an uninterrupted run's from the resumed iteration on. Needs two CUDA devices; skipped
otherwise.

    python -m pytest -q tests/gpu/test_fault_drills_gpu.py
"""
import os
import re
import time

import pytest
import torch

from tests.functional.cli_runner import ROOT, CliRunner
from tests.functional.fault_drill_driver import read_records
from tests.functional.torchrun import torchrun

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

DRIVER = "tests/functional/fault_drill_driver.py"
ITERS = 8
FLAGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
         "--micro-batch-size 2 --global-batch-size 4 --bf16 --deterministic-mode --lr 3e-4 --lr-warmup-iters 2 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --log-interval 1 --eval-iters 0 "
         f"--num-workers 0 --train-iters {ITERS} --save-interval 2").split()
TIMEOUT_S = 20
LOADED = re.compile(r"successfully loaded checkpoint from \S+ \[.*\] at iteration (\d+)")


@pytest.fixture(scope="module")
def cli():
    with CliRunner(gpus=True) as runner:
        yield runner


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")}
    return {**env, "PYTHONPATH": ROOT}


@pytest.fixture(scope="module")
def reference(cli, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("reference") / "rec"
    results = cli.run([DRIVER] + FLAGS, nranks=2, timeout=600, env={"DRILL_RECORD": str(prefix)})
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:] + results[1].err[-3000:]
    ref = {rank: {r["iteration"]: (r["loss"], r["consumed"], r["batches"]) for r in read_records(prefix, rank)}
           for rank in (0, 1)}
    assert sorted(ref[0]) == list(range(1, ITERS + 1)) and len({v[0] for v in ref[0].values()}) > ITERS // 2
    return ref


def _check_continues(reference, prefix, resumed, launch=None):
    for rank in (0, 1):
        records = read_records(prefix, rank)
        for r in records:
            assert (r["loss"], r["consumed"], r["batches"]) == reference[rank][r["iteration"]], (rank, r)
        last = [r for r in records if launch is None or r["launch"] == launch]
        assert [r["iteration"] for r in last] == list(range(resumed + 1, ITERS + 1)), (rank, last)


def test_sigkill_one_rank_nccl_torchrun_restarts_and_resumes(tmp_path, reference):
    d = str(tmp_path / "ckpt")
    prefix = tmp_path / "rec"
    env = {**_env(), "DRILL_RECORD": str(prefix), "DRILL_FAULT": "sigkill:1:5"}
    p = torchrun(2, ["--max-restarts", "1", "--monitor-interval", "0.5", os.path.join(ROOT, DRIVER)] + FLAGS
                 + ["--save", d, "--load", d, "--async-save"], cwd=ROOT, env=env, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "launch 2 of this run (restart 1; launcher restart count 1)" in out, out[-5000:]
    assert re.search(r"> previous launch \(started \S+\) ended: failed: ", out)
    resumed = int(LOADED.search(out).group(1))
    assert resumed in (2, 4)
    _check_continues(reference, prefix, resumed, launch=1)


def test_sigstop_one_rank_nccl_hang_dumps_and_restart_resumes(cli, tmp_path, reference):
    d = str(tmp_path / "ckpt")
    dumps = str(tmp_path / "hang_rank")
    flags = FLAGS + ["--save", d, "--load", d, "--distributed-timeout-seconds-after-init", str(TIMEOUT_S),
                     "--flight-recorder-dump-path", dumps]
    start = time.time()
    results = cli.run([DRIVER] + flags, nranks=2, timeout=600,
                      env={"DRILL_RECORD": str(tmp_path / "first"), "DRILL_FAULT": "sigstop:1:3:40"})
    elapsed = time.time() - start
    assert all(r.rc not in (0, "timeout") for r in results), [r.err[-2000:] for r in results]
    # 40 s frozen, then rank 1's own NCCL timeout; start-up and the first iterations take the rest.
    assert elapsed < 40 + 2 * TIMEOUT_S + 120, elapsed
    for rank in (0, 1):
        dump = open(f"{dumps}{rank}.stacks.txt").read()
        assert "## last collectives of this rank" in dump and "## Python stacks of every thread" in dump
    assert re.search(r"no progress for (\d+\.\d) s", open(f"{dumps}1.stacks.txt").read())  # the frozen rank
    assert os.path.exists(f"{dumps}0"), os.listdir(tmp_path)  # NCCL's flight-recorder trace of rank 0
    results = cli.run([DRIVER] + flags, nranks=2, timeout=600, env={"DRILL_RECORD": str(tmp_path / "restart")})
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:]
    assert int(LOADED.search(results[0].out).group(1)) == 2
    _check_continues(reference, tmp_path / "restart", 2)
