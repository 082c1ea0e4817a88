"""tools/bench_checkpoint.py end to end on 2 gloo ranks, in the layouts docs/fault_tolerance.md gives for two 80 GB
GPUs: a TP=2 (+ SP, distributed optimizer) run measures the disk, a synchronous and an async save and keeps the
last checkpoint; a PP=2 run loads it (a resharding load) and takes a step. Every measurement line is printed."""
import os
import subprocess
import sys

from tests.functional.torchrun import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(tmp_path, *args):
    # On a free port: --standalone adds a rendezvous round to each launch (tests/functional/torchrun.py).
    p = torchrun(2, [os.path.join(ROOT, "tools", "bench_checkpoint.py"), "--config", "tiny", "--save-dir",
                     str(tmp_path / "ck"), *args, "--distributed-timeout-minutes", "5"], cwd=ROOT, timeout=420,
                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_tp2_save_then_pp2_resharding_load(tmp_path):
    # --num-workers 0: batches read in the rank itself; no loader worker forked beside gloo's threads (the PP=2 load
    # once stalled on CI with both ranks outside any collective, and a stuck worker is one way to get there).
    common = ["--num-layers", "4", "--global-batch-size", "2", "--use-distributed-optimizer", "--num-workers", "0"]
    # --profile-save and --sync-repeat: the profiled save's phases and functions, and a repeat whose iteration
    # leaves the async save's (2, loaded below) alone.
    out = _bench(tmp_path, "--keep", "--no-anchor", "--async-saves", "1", "--disk-gib", "0.01", "--profile-save",
                 "--sync-repeat", "2", "--", *common, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    for line in ("checkpoint disk |", "checkpoint sync | TP=2 PP=1 DP=1 distopt=1", "checkpoint async | blocked",
                 "profile | phase generate_state_dict ", "profile | phase dcp_write ", "profile | phase total ",
                 "profile | top 25 by tottime", "profile | top 25 by cumtime", "checkpoint sync again | save "):
        assert line in out, out[-3000:]
    assert "n/a" not in "".join(line for line in out.splitlines() if line.startswith("profile | phase")), out[-3000:]
    out = _bench(tmp_path, "--load-only", "--", *common, "--pipeline-model-parallel-size", "2")
    assert "checkpoint load | TP=1 PP=2 DP=1 distopt=1 | iteration 2" in out, out[-3000:]


def test_synchronous_saves_only(tmp_path):
    """--async-saves 0 (one process): the synchronous save and its repeats, no reservation or async save; what a
    device call with a time limit runs to tell a slow first write from a slow code path."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_checkpoint.py"), "--config", "tiny",
                        "--save-dir", str(tmp_path / "ck"), "--no-anchor", "--async-saves", "0", "--sync-repeat", "2",
                        "--disk-gib", "0.001", "--", "--num-layers", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "checkpoint sync | " in p.stdout and p.stdout.count("checkpoint sync again | save ") == 1, p.stdout[-3000:]
    assert "checkpoint reserve" not in p.stdout and "checkpoint async" not in p.stdout, p.stdout[-3000:]
