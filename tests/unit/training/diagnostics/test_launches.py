"""The launch record: launches are counted, a failed launch is diagnosed from its ranks' notes (or their
silence) at the next start, a clean end is recorded, and the record is never half-written."""
import argparse
import json
import os

from megatron.training.diagnostics import errors, launches


def _begin(save, capsys, env=None, monkeypatch=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    entry = launches.begin(argparse.Namespace(save=save))
    return entry, capsys.readouterr().out


def test_launches_counted_and_a_silent_failure_diagnosed(tmp_path, capsys, monkeypatch):
    save = str(tmp_path / "ckpt")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    entry, out = _begin(save, capsys)
    assert entry["launch"] == 1 and "launch 1 of this run (restart 0)" in out and "previous launch" not in out
    # The launch ends without a word (kill -9): the next one says so, with the launcher's restart count.
    entry, out = _begin(save, capsys, {"TORCHELASTIC_RESTART_COUNT": "1"}, monkeypatch)
    assert "launch 2 of this run (restart 1; launcher restart count 1)" in out
    assert "ended: failed: no rank reported an error: the processes were killed" in out
    launches.end("completed at iteration 6")
    record = json.load(open(os.path.join(save, launches.RECORD_FNAME)))
    assert record["launch_count"] == 2
    assert [e["outcome"] for e in record["launches"]][1] == "completed at iteration 6"
    assert not [n for n in os.listdir(save) if ".tmp" in n]  # the atomic write left no temp file


def test_failure_notes_name_the_first_error_and_the_silent_ranks(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    launches.begin(argparse.Namespace(save=save))
    launches.in_iteration(5)
    launches._note_failure(RuntimeError("Connection closed by peer"))  # what errors.report runs on a failing rank
    note = json.load(open(os.path.join(save, launches.FAILURES_DIR, "rank0.json")))
    assert (note["rank"], note["iteration"], note["cause"]) == (0, 5, "RuntimeError: Connection closed by peer")
    # As if the launch had two ranks and rank 1 died silently; a later note of rank 2 comes after it.
    record = launches.read_record(save)
    record["launches"][-1]["world_size"] = 3
    launches.write_json_atomic(launches.record_path(save), record)
    launches.write_json_atomic(os.path.join(save, launches.FAILURES_DIR, "rank2.json"),
                               {"rank": 2, "time": note["time"] + 1, "iteration": 5, "cause": "OSError: x"})
    capsys.readouterr()
    launches.begin(argparse.Namespace(save=save))
    out = capsys.readouterr().out
    assert ("ended: failed: rank 0 in iteration 5: RuntimeError: Connection closed by peer; 1 more rank(s) failed "
            "after it; rank(s) 1 reported nothing (killed: SIGKILL, the OOM killer or a lost node)") in out, out
    assert not os.path.exists(os.path.join(save, launches.FAILURES_DIR))  # the notes were read and cleared
    launches.end("exited at iteration 6 (--exit-interval)")


def test_no_save_records_nothing_and_errors_hook_registered(tmp_path):
    assert launches.begin(argparse.Namespace(save=None)) is None
    launches.end("completed")  # nothing to record: no error
    launches.begin(argparse.Namespace(save=str(tmp_path)))
    assert launches._note_failure in errors._ON_ERROR
    launches.end("completed")


def test_unreadable_record_starts_over(tmp_path):
    with open(launches.record_path(str(tmp_path)), "w") as f:
        f.write("{half a reco")
    assert launches.read_record(str(tmp_path)) == {"launch_count": 0, "launches": []}
    assert launches.diagnose([], 2).startswith("no rank reported an error")
