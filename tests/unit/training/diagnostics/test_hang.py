"""The hang dump of a rank that was itself stopped: its stall and the failed wait, whichever thread runs first."""
import argparse
import os
import time
import types

import pytest
import torch

from megatron.training.diagnostics import errors, hang


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group (kept when an earlier test of this worker made one, as other tests do)."""
    created = not torch.distributed.is_initialized()
    if created:
        store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert torch.distributed.get_world_size() == 1
    yield
    hang.uninstall()
    if created:
        torch.distributed.destroy_process_group()


def test_stopped_rank_dumps_its_stall_then_the_failed_wait(one_rank, tmp_path, capsys):
    """SIGSTOP inside a collective, then the peer is gone: on thaw the main thread's wait fails at once,
    before the watchdog polls. The error path must still write the stall and name the failed collective."""
    args = argparse.Namespace(distributed_timeout_seconds_after_init=None, distributed_timeout_minutes=1,
                              flight_recorder_dump_path=str(tmp_path / "hang_rank"))
    hang.install(args)
    state = hang._STATE
    state.stop.set()  # the watchdog thread never looks: the main thread runs first after the thaw

    def frozen_then_peer_gone(*_args, **_kwargs):
        state.recorder.calls[-1]["start"] -= 100.0  # it started 100 s ago, then the process stood still
        state.recorder.last_progress -= 100.0
        raise RuntimeError("Connection closed by peer [127.0.0.1]:28312")

    wrapped = hang._wrap("all_gather", frozen_then_peer_gone, state.recorder)
    with pytest.raises(RuntimeError) as failure:
        wrapped(torch.zeros(3))
    # A raised collective is no longer waited in; the error report finds it as the last failure.
    assert state.recorder.in_flight() is None and state.recorder.last_failed()["op"] == "all_gather"
    errors.report(failure.value)
    err = capsys.readouterr().err
    path = str(tmp_path / "hang_rank") + "0.stacks.txt"
    assert "[rank 0] hang: no progress for 100" in err and path in err
    dump = open(path).read()
    assert "waiting in all_gather #0" in dump  # the stall, as the watchdog would have written it
    assert "all_gather #0 failed after 100" in dump and "## the failed call" in dump  # then the failure
    assert "FAILED after 100" in dump and err.rstrip().endswith("RuntimeError: Connection closed by peer "
                                                                 "[127.0.0.1]:28312")


def test_a_short_failed_wait_is_an_error_not_a_hang(one_rank, tmp_path, capsys):
    args = argparse.Namespace(distributed_timeout_seconds_after_init=None, distributed_timeout_minutes=1,
                              flight_recorder_dump_path=str(tmp_path / "hang_rank"))
    hang.install(args)
    state = hang._STATE
    state.stop.set()

    def peer_gone(*_args, **_kwargs):
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError) as failure:
        hang._wrap("all_reduce", peer_gone, state.recorder)(torch.zeros(1))
    errors.report(failure.value)
    assert "hang:" not in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "hang_rank") + "0.stacks.txt")


def test_a_rank_stopped_between_steps_records_its_stall_at_the_next_step(one_rank, tmp_path, capsys):
    """SIGSTOP after a step's last collective: on thaw the loop's heartbeat runs before any collective (and
    before the watchdog polls); the stall must be written then, not erased as progress."""
    args = argparse.Namespace(distributed_timeout_seconds_after_init=None, distributed_timeout_minutes=1,
                              flight_recorder_dump_path=str(tmp_path / "hang_rank"))
    hang.install(args)
    state = hang._STATE
    state.stop.set()
    hang._wrap("all_reduce", lambda *a, **k: None, state.recorder)(torch.zeros(1))
    state.recorder.last_progress -= 100.0  # the process stood still for 100 s after that collective
    hang.heartbeat()
    err = capsys.readouterr().err
    path = str(tmp_path / "hang_rank") + "0.stacks.txt"
    assert "[rank 0] hang: no progress for 100" in err and path in err
    assert "all_reduce" in open(path).read()
    hang.heartbeat()  # a step right after: no new stall, nothing more written
    assert "hang:" not in capsys.readouterr().err


def test_wait_notice_speaks_only_while_the_call_is_slow(capsys):
    """A blocked start-up rendezvous says, on each rank, what it waits for; a fast one says nothing."""
    with hang.WaitNotice(0.05, lambda: "rank 1 of 2 in the rendezvous at h:1"):
        time.sleep(0.3)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) >= 2 and all(line.startswith("still waiting after ") for line in lines)
    assert lines[0].endswith("s: rank 1 of 2 in the rendezvous at h:1")
    with hang.WaitNotice(5.0, lambda: "never"):
        pass
    assert capsys.readouterr().err == ""


def test_rendezvous_text_names_the_address_and_the_flag(monkeypatch):
    from megatron.training.initialize import _rendezvous_text
    monkeypatch.setenv("MASTER_ADDR", "node7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    text = _rendezvous_text(types.SimpleNamespace(rank=3, world_size=8, distributed_backend="nccl"))
    assert text.startswith("rank 3 of 8 in torch.distributed's rendezvous at node7:29500 (--distributed-backend nccl)")


def test_default_dump_prefix_tells_torchrun_jobs_apart(monkeypatch):
    """torchrun without --rdzv-id names every run "none": the prefix then falls back to the master port, so two
    jobs on one host (CI's parallel tests) write their own dumps."""
    args = types.SimpleNamespace(flight_recorder_dump_path=None)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29611")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert hang.dump_prefix(args).endswith("megatron_hang_29611_rank")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert hang.dump_prefix(args).endswith("megatron_hang_job7_rank")
