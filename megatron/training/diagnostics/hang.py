"""Hang diagnosis: a stalled run leaves every rank's Python stacks and its last collectives in a file.

- A recorder wraps torch.distributed's collective functions (our code calls them as attributes of
  `torch.distributed`) and keeps the last calls of this rank: op, tensor, group size, start, end.
- A watchdog thread watches progress (a collective starting or finishing, a training step). After 90% of
  `--distributed-timeout-minutes` (or `--distributed-timeout-seconds-after-init`) without any, it writes
  `<prefix><rank>.stacks.txt`: the recorded collectives, then every thread's stack (faulthandler), and
  logs one line naming the file. The rank that never reached the collective is found this way. 90%: the
  dump must be on disk before the waiting ranks' collectives fail and the launcher stops every rank.
- A rank whose collective times out writes the same dump from the error path, with the traceback of the
  failed wait.
- On NCCL, torch's flight recorder is configured from Megatron's --flight-recorder-* flags so that NCCL's
  own trace is dumped at a timeout too (`<prefix><rank>`).
The watchdog only writes: the run ends when the waiting ranks' collectives time out.
"""
import collections
import datetime
import faulthandler
import functools
import os
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch
from torch.distributed import distributed_c10d as c10d

from megatron.training.diagnostics import errors

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send", "recv",
               "batch_isend_irecv")
# isend / irecv stay unwrapped: torch.distributed.P2POp accepts only those very functions as its op (the
# pipeline schedules build P2POps from them); their batches are recorded through batch_isend_irecv.
HISTORY = 64
_ORIGINALS = {}
_STATE = None


class CollectiveRecorder:
    """The last `HISTORY` collectives of this rank, and when progress was last made."""

    def __init__(self):
        self.calls = collections.deque(maxlen=HISTORY)
        self.sequence = 0
        self.last_progress = time.monotonic()
        self.blocked_s = 0.0  # time spent inside synchronous collectives (waiting for the other ranks)
        self.on_stall = None  # called with the idle time at each collective start (a rank back from a stall)
        self.lock = threading.Lock()

    def start(self, name, args, kwargs):
        if self.on_stall is not None:
            self.on_stall(time.monotonic() - self.last_progress)
        tensor = next((a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)), None)
        group = kwargs.get("group")
        entry = {"seq": self.sequence, "op": name, "start": time.time(), "end": None,
                 "async": bool(kwargs.get("async_op", False)) or name in ("isend", "irecv", "batch_isend_irecv"),
                 "tensor": f"{tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')} {tensor.device}"
                 if tensor is not None else "",
                 "group": torch.distributed.get_world_size(group) if group is not None else "world"}
        with self.lock:
            self.sequence += 1
            self.calls.append(entry)
            self.last_progress = time.monotonic()
        return entry

    def finish(self, entry):
        entry["end"] = time.time()
        if not entry["async"]:
            self.blocked_s += entry["end"] - entry["start"]
        self.last_progress = time.monotonic()

    def in_flight(self):
        """The oldest synchronous collective that has not returned (nor raised), or None."""
        with self.lock:
            return next((c for c in self.calls if c["end"] is None and not c["async"] and not c.get("failed")),
                        None)

    def last_failed(self):
        """The newest collective that raised, or None."""
        with self.lock:
            return next((c for c in reversed(self.calls) if c.get("failed")), None)

    def lines(self):
        with self.lock:
            calls = list(self.calls)
        now = time.time()
        out = []
        for c in calls:
            state = (f"FAILED after {c['failed'] - c['start']:.1f} s" if c.get("failed") else
                     "issued (async)" if c["async"] and c["end"] is not None else
                     f"done in {c['end'] - c['start']:.3f} s" if c["end"] is not None else
                     f"WAITING for {now - c['start']:.1f} s")
            out.append(f"#{c['seq']:<6d} {c['op']:<22s} {c['tensor']:<36s} group={c['group']!s:<6s} "
                       f"at {datetime.datetime.fromtimestamp(c['start']).strftime('%H:%M:%S.%f')[:-3]}  {state}")
        return out


def _wrap(name, fn, recorder):
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced into a graph: nothing to record at run time
            return fn(*args, **kwargs)
        entry = recorder.start(name, args, kwargs)
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            entry["failed"] = time.time()  # the error report names the wait that failed
            raise
        recorder.finish(entry)
        return result
    return recorded


class _State:
    def __init__(self, timeout_s, prefix, rank):
        self.recorder = CollectiveRecorder()
        self.timeout_s, self.prefix, self.rank = timeout_s, prefix, rank
        self.path = f"{prefix}{rank}.stacks.txt"
        self.dumped = False
        self.dump_lock = threading.Lock()
        self.stop = threading.Event()


def dump_prefix(args):
    """`--flight-recorder-dump-path` or a per-run prefix in the temp directory."""
    if args.flight_recorder_dump_path:
        folder = os.path.dirname(args.flight_recorder_dump_path)
        if folder:  # e.g. <checkpoints>/hang_dumps/rank: the folder is made once, by whichever rank comes first
            os.makedirs(folder, exist_ok=True)
        return args.flight_recorder_dump_path
    # torchrun without --rdzv-id names every run "none": two jobs on one host would share one dump file.
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    run = (elastic if elastic and elastic != "none" else None) or os.environ.get("SLURM_JOB_ID") or \
        os.environ.get("MASTER_PORT", str(os.getpid()))
    return os.path.join(tempfile.gettempdir(), f"megatron_hang_{run}_rank")


def timeout_seconds(args):
    after_init = args.distributed_timeout_seconds_after_init
    return after_init if after_init is not None else args.distributed_timeout_minutes * 60


def configure_flight_recorder(args):
    """torch's NCCL flight recorder, from Megatron's flags; call before init_process_group (NCCL only)."""
    if args.distributed_backend != "nccl" or not torch.cuda.is_available():
        return
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(args.flight_recorder_trace_buffer_size),
           "TORCH_NCCL_DUMP_ON_TIMEOUT": str(int(args.flight_recorder_dump_on_timeout)),
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump_prefix(args),
           "TORCH_INCLUDE_STACK_TRACE": str(int(args.flight_recorder_include_stack_trace)),
           "TORCH_INCLUDE_ONLY_ACTIVE": str(int(args.flight_recorder_include_only_active)),
           "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": str(int(args.flight_recorder_extra_dump_on_exec))}
    for key, value in env.items():
        os.environ.setdefault(key, value)  # an explicit environment wins


def install(args):
    """Start recording collectives and watching for a stall (every rank, after the groups exist)."""
    global _STATE
    uninstall()
    _STATE = _State(timeout_seconds(args), dump_prefix(args), torch.distributed.get_rank())
    _STATE.recorder.on_stall = functools.partial(_check_stall, _STATE)
    for name in COLLECTIVES:
        fn = getattr(torch.distributed, name, None)
        if fn is not None:
            _ORIGINALS[name] = fn
            setattr(torch.distributed, name, _wrap(name, fn, _STATE.recorder))
    if args.distributed_timeout_seconds_after_init is not None:
        _set_group_timeouts(args.distributed_timeout_seconds_after_init)
    errors.on_error(_dump_on_error)
    threading.Thread(target=_watch, args=(_STATE,), name="hang-watchdog", daemon=True).start()
    if _STATE.rank == 0:
        print(f"> hang watchdog: after {_STATE.timeout_s:g} s without progress each rank writes its stacks "
              f"and last collectives to {_STATE.prefix}<rank>.stacks.txt", flush=True)


def uninstall():
    global _STATE
    for name, fn in _ORIGINALS.items():
        setattr(torch.distributed, name, fn)
    _ORIGINALS.clear()
    if _STATE is not None:
        _STATE.stop.set()
    _STATE = None


def _set_group_timeouts(seconds):
    """Megatron's --distributed-timeout-seconds-after-init: every existing group gets the new timeout."""
    for group in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)
        except (ValueError, AssertionError, RuntimeError):
            pass  # a group this rank is not part of


def blocked_seconds():
    """Seconds this rank has spent inside synchronous collectives so far (0 when not installed)."""
    return _STATE.recorder.blocked_s if _STATE is not None else 0.0


def dump_path():
    """This rank's dump file when it wrote one in this run, else None."""
    return _STATE.path if _STATE is not None and os.path.exists(_STATE.path) and _STATE.dumped else None


def heartbeat():
    """The training loop made progress (a step started or ended). A rank back from a stall (stopped, swapped
    out) between its last collective and this call records the stall first, as the watchdog would have: the
    watchdog thread stood still too, and the progress marked here would otherwise hide it."""
    if _STATE is not None:
        _check_stall(_STATE, time.monotonic() - _STATE.recorder.last_progress)
        _STATE.recorder.last_progress = time.monotonic()
        _STATE.dumped = False


def _watch(state):
    poll = min(max(state.timeout_s / 10, 0.2), 5.0)
    while not state.stop.wait(poll):
        _check_stall(state, time.monotonic() - state.recorder.last_progress)


def _check_stall(state, idle, waiting=None):
    """Dump once per stall: from the watchdog thread, or from the main thread at its next collective when
    the whole process stood still (stopped, swapped out) and the watchdog could not run either.
    ``waiting``: the collective the rank sat in (default: the oldest one in flight)."""
    if idle < 0.9 * state.timeout_s or state.dumped:
        return
    with state.dump_lock:
        if state.dumped:
            return
        waiting = waiting or state.recorder.in_flight()
        where = (f"waiting in {waiting['op']} #{waiting['seq']}" if waiting else
                 "not in a collective (this rank may be the one the others wait for)")
        write_dump(state, f"no progress for {idle:.1f} s, {where}")


def write_dump(state, reason, exc=None):
    """Write this rank's dump file and log one line naming it; returns the path."""
    mode = "a" if state.dumped else "w"  # a later failure is added to the stall's dump, not written over it
    state.dumped = True
    with open(state.path, mode) as f:
        f.write(f"# hang dump: rank {state.rank} of {torch.distributed.get_world_size()} on "
                f"{socket.gethostname()} pid {os.getpid()} at {datetime.datetime.now().isoformat()}\n")
        f.write(f"# reason: {reason}\n## last collectives of this rank (oldest first)\n")
        f.write("\n".join(state.recorder.lines()) + "\n")
        if exc is not None:
            f.write("## the failed call\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        f.write("## Python stacks of every thread (most recent call first)\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    print(f"[rank {state.rank}] hang: {reason}; stacks and last collectives in {state.path}",
          file=sys.stderr, flush=True)
    return state.path


def _dump_on_error(exc):
    """A rank whose collective timed out records where it was waiting (its stacks, the failed call)."""
    state = _STATE
    if state is None:
        return
    # A rank that was itself stopped (SIGSTOP, swapped out) meets the error as soon as it runs again, maybe
    # before its watchdog thread looks: its stall is recorded first, as the watchdog would have.
    waiting = state.recorder.last_failed() or state.recorder.in_flight()
    _check_stall(state, time.monotonic() - state.recorder.last_progress, waiting)
    # Only a wait that lasted (a timeout), not one a departed peer cut short: that is an error, not a hang.
    waited = (waiting.get("failed") or time.time()) - waiting["start"] if waiting is not None else 0.0
    if waited >= 0.5 * state.timeout_s:
        write_dump(state, f"{waiting['op']} #{waiting['seq']} failed after {waited:.1f} s: {errors.error_line(exc)}",
                   exc)


class WaitNotice:
    """A context manager for a blocking call with no progress of its own to report (the start-up rendezvous):
    while the block runs longer than ``after_s``, one line goes to stderr every ``after_s`` seconds with how
    long it has waited and ``describe()``, so a rank held at start-up says where it stands before its timeout
    (10 minutes by default) ends it."""

    def __init__(self, after_s: float, describe):
        self.after_s, self.describe = after_s, describe
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        start = time.monotonic()
        while not self._stop.wait(self.after_s):
            print(f"still waiting after {time.monotonic() - start:.0f} s: {self.describe()}", file=sys.stderr,
                  flush=True)

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name="wait-notice", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False
