"""The launch record next to the checkpoints: how often this run was (re)started and how each launch ended.

A job restarted by its launcher (`torchrun --max-restarts`, a SLURM requeue, a Kubernetes restart policy)
runs the same command again; it resumes from the latest checkpoint under --load (= --save). This module
tells the user why it had to:

- `<save>/launch_record.json` (rank 0, written atomically): one entry per launch with its start time,
  world size, the launcher's restart count and its outcome; the last `KEEP` launches and a total count.
- `<save>/launch_failures/rank<R>.json`: a rank that fails with an error writes one line (time,
  iteration, `Type: message`) before it exits. A rank that dies without a word (SIGKILL, the OOM killer,
  a lost node) writes nothing, and that silence is the diagnosis.
- At start, rank 0 turns the previous launch's notes into its outcome (the earliest error first, then the
  silent ranks), logs it with the launch count, and clears the notes.
"""
import json
import os
import sys
import time
from datetime import datetime
from typing import Optional

import torch

from megatron.training.diagnostics import errors, hang

RECORD_FNAME = "launch_record.json"
FAILURES_DIR = "launch_failures"
KEEP = 20  # launches kept in the record (the total count is kept too)
_STATE = {"save": None, "iteration": None}


def record_path(save_dir: str) -> str:
    return os.path.join(save_dir, RECORD_FNAME)


def write_json_atomic(path: str, obj) -> None:
    """Write ``obj`` as JSON to a temp file, fsync, then rename over ``path`` (never half-written)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_record(save_dir: str) -> dict:
    """The record under ``save_dir``; an empty one when it is missing or unreadable."""
    try:
        with open(record_path(save_dir)) as f:
            record = json.load(f)
        if isinstance(record, dict) and isinstance(record.get("launches"), list):
            return record
    except (OSError, ValueError):
        pass
    return {"launch_count": 0, "launches": []}


def launcher_restart_count() -> Optional[int]:
    """torchrun's TORCHELASTIC_RESTART_COUNT or SLURM's SLURM_RESTART_COUNT (a requeued job), if set."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def _now() -> str:
    return datetime.now().isoformat(timespec="seconds")


def read_failures(save_dir: str) -> list:
    """The failure notes ranks left in the previous launch, earliest first."""
    folder = os.path.join(save_dir, FAILURES_DIR)
    notes = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    notes.append(json.load(f))
            except (OSError, ValueError):
                continue  # a note cut short by the end of its process
    return sorted(notes, key=lambda n: n.get("time", 0.0))


def diagnose(notes: list, world_size: Optional[int]) -> str:
    """One line: why a launch ended without a clean exit, from its ranks' notes."""
    silent = sorted(set(range(world_size or 0)) - {n.get("rank") for n in notes})
    if not notes:
        return ("no rank reported an error: the processes were killed (SIGKILL, the OOM killer, a lost node) "
                "or stopped by the launcher")
    first = notes[0]
    where = f" in iteration {first['iteration']}" if first.get("iteration") is not None else " during start-up"
    text = f"rank {first.get('rank')}{where}: {first.get('cause')}"
    if first.get("hang_dump"):
        text += f" (hang dump {first['hang_dump']})"
    if len(notes) > 1:
        text += f"; {len(notes) - 1} more rank(s) failed after it"
    if silent:
        shown = ", ".join(map(str, silent[:8])) + (" ..." if len(silent) > 8 else "")
        text += f"; rank(s) {shown} reported nothing (killed: SIGKILL, the OOM killer or a lost node)"
    return text


def _clear_failures(save_dir: str) -> None:
    folder = os.path.join(save_dir, FAILURES_DIR)
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        try:
            os.remove(os.path.join(folder, name))
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


def begin(args) -> Optional[dict]:
    """Every rank, once the process groups exist: rank 0 closes the previous launch's entry, opens this
    one and logs both; a barrier keeps other ranks from writing notes before the old ones are cleared.
    No --save: nothing is recorded."""
    _STATE["save"], _STATE["iteration"] = args.save or None, None  # nothing left over from an earlier run
    if not args.save:
        return None
    errors.on_error(_note_failure)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    entry = None
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        record = read_record(args.save)
        previous = record["launches"][-1] if record["launches"] else None
        if previous is not None and previous.get("outcome") is None:
            previous["outcome"] = "failed: " + diagnose(read_failures(args.save), previous.get("world_size"))
        _clear_failures(args.save)
        record["launch_count"] = int(record.get("launch_count", len(record["launches"]))) + 1
        entry = {"launch": record["launch_count"], "start": _now(), "world_size": world,
                 "launcher_restart_count": launcher_restart_count(),
                 "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"), "outcome": None}
        record["launches"] = (record["launches"] + [entry])[-KEEP:]
        write_json_atomic(record_path(args.save), record)
        _log_begin(args.save, entry, previous)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return entry


def _log_begin(save_dir, entry, previous) -> None:
    restarts = entry["launcher_restart_count"]
    launcher = f"; launcher restart count {restarts}" if restarts is not None else ""
    print(f"> launch record {record_path(save_dir)}: launch {entry['launch']} of this run "
          f"(restart {entry['launch'] - 1}{launcher})", flush=True)
    if previous is not None:
        print(f"> previous launch (started {previous.get('start')}) ended: {previous['outcome']}", flush=True)


def in_iteration(iteration: int) -> None:
    """The training loop is running ``iteration`` (a failure note names it; before: start-up)."""
    _STATE["iteration"] = iteration


def end(outcome: str) -> None:
    """Rank 0 records how this launch ended (a completed run, an exit condition, a rerun-engine stop)."""
    save = _STATE["save"]
    if save is None or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    record = read_record(save)
    if record["launches"] and record["launches"][-1].get("outcome") is None:
        record["launches"][-1]["outcome"] = outcome
        record["launches"][-1]["end"] = _now()
        write_json_atomic(record_path(save), record)
    _STATE["save"] = None


def _note_failure(exc) -> None:
    """errors' hook on a failing rank: leave a one-line note for the next launch to read."""
    save = _STATE["save"]
    if save is None:
        return
    line = errors.error_line(exc)
    note = {"rank": errors.current_rank(), "time": time.time(), "iteration": _STATE["iteration"],
            "cause": line.split("] ", 1)[1] if line.startswith("[rank ") else line, "hang_dump": hang.dump_path()}
    folder = os.path.join(save, FAILURES_DIR)
    try:
        os.makedirs(folder, exist_ok=True)
        write_json_atomic(os.path.join(folder, f"rank{note['rank']}.json"), note)
    except OSError as e:  # a full or unreachable disk: the error itself is still reported on stderr
        print(f"[rank {note['rank']}] (could not write the failure note under {folder}: {e})", file=sys.stderr)
