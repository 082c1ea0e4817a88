"""How a failing run ends: `[rank R] Type: message` on stderr of the rank that failed, and a non-zero exit
on every rank within seconds.

Bad inputs (`InputError`, which `ArgumentError` is, refused features, unreadable checkpoints) print
only that line; any other
exception prints its traceback first. Exit codes: 2 for bad inputs (argparse's convention), 1 otherwise,
or the code a `SystemExit` carries (the rerun state machine's 16 and 17).

Ranks that are waiting for the failed one learn about it from their own collective: with gloo a peer that
exits closes its sockets and the wait fails at once; with NCCL the launcher (torchrun, or srun with
--kill-on-bad-exit) ends them. A start-up failure happens before any collective, so `agree_on_start`
adds one at the end of start-up that every rank reaches, failed or not.
"""
import contextlib
import os
import sys
import traceback

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.errors import InputError

# Called with the exception before the exit (the hang watchdog writes its dump there).
_ON_ERROR = []


def current_rank():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def is_input_error(exc):
    """Bad inputs, refused features and unreadable checkpoints: their message names the flag or file."""
    return isinstance(exc, (InputError, NotImplementedError, CheckpointingException))


def error_line(exc):
    """`[rank R] Type: first line of the message` (the whole message is one line for input errors)."""
    message = str(exc).strip().splitlines()
    return f"[rank {current_rank()}] {type(exc).__name__}: {message[0] if message else ''}".rstrip()


def exit_code(exc):
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else 1
    return 2 if is_input_error(exc) else 1


def on_error(fn):
    """Register ``fn(exc)`` to run before a failing rank exits."""
    if fn not in _ON_ERROR:
        _ON_ERROR.append(fn)


def report(exc):
    """Print the error on this rank's stderr: the traceback (unless a bad input), then the one line."""
    sys.stdout.flush()
    if not is_input_error(exc):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    for fn in list(_ON_ERROR):
        try:
            fn(exc)
        except Exception as hook_error:  # a broken hook must not hide the original error
            print(f"[rank {current_rank()}] (while reporting: {hook_error!r})", file=sys.stderr)
    print(error_line(exc), file=sys.stderr, flush=True)


def library_mode():
    """pretrain() called in-process by code that owns the process group and handles the exception itself
    (the tests' run_distributed sets MEGATRON_RAISE_ERRORS=1): a failing rank must raise, never end the
    process, or its caller only learns of it at its own timeout."""
    return os.environ.get("MEGATRON_RAISE_ERRORS") == "1"


def exit_now(code):
    """Exit without tearing down process groups a failed peer left half-open (that teardown can block);
    a single process, or one in library mode, exits normally so in-process callers see SystemExit."""
    sys.stdout.flush()
    sys.stderr.flush()
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1 and not library_mode():
        os._exit(code)
    sys.exit(code)


@contextlib.contextmanager
def report_errors():
    """Wrap an entry point: any exception is reported on this rank and ends the process non-zero."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        report(exc)
        if library_mode():
            raise
        exit_now(exit_code(exc))


def agree_on_start(failed):
    """Every rank calls this once its default process group exists; returns True when some rank failed
    start-up, so that ranks which passed exit too instead of waiting in the next collective."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return failed
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
