"""Run a function on N real processes joined by a gloo process group (CPU).

Every multi-rank test goes through `run_distributed`: it spawns one process per rank, initialises
torch.distributed over gloo on a free localhost port, calls ``fn(*args)`` on each rank and returns the
per-rank results in rank order, or raises the first rank failure with that rank's traceback.
"""
import faulthandler
import os
import pickle
import signal
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from a server process that has already imported torch and megatron (forkserver with
# preloaded modules): a new rank starts in ~0.1 s instead of re-importing torch for ~3 s, which is most of
# a small multi-rank test's cost on a 2-core machine. The server never runs torch ops, so forking it is
# safe (no OpenMP or other threads to inherit), unlike forking the test process itself.
# The checkpoint code (torch.distributed.checkpoint) loads lazily in a run; many tests save, so preload it here.
# Last, tests.parallel.forkserver_gc_freeze moves all of it into the collector's permanent generation.
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch._dynamo", "numpy",
            "megatron.core", "megatron.core.parallel_state", "megatron.training",
            "megatron.core.dist_checkpointing.serialization", "tests.parallel.forkserver_gc_freeze"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank, world_size, port, fn, args, kwargs, queue, env=None, cwd=None):
    if env is not None:  # the server's environment is the one of its start: use the caller's current one
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MEGATRON_RAISE_ERRORS="1",  # an error inside pretrain() reaches the queue below instead of exiting
    )
    torch.set_num_threads(1)
    # A native crash (SIGSEGV, abort) reports nothing to the queue: print every thread's stack to stderr.
    faulthandler.enable()
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        # Plain pickle, not torch's fd-sharing reducer: the child may exit before the parent reads.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_distributed(fn, world_size, *args, timeout=300, **kwargs):
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the list of results by rank.
    The free port is only free when it is picked: if another process takes it before rank 0 listens
    (parallel test workers), the world is started again on a new port (nothing of ``fn`` ran yet)."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout)
        except RuntimeError as e:
            rendezvous = "in _worker\n    torch.distributed.init_process_group" in str(e)
            if not (rendezvous and "EADDRINUSE" in str(e)) or attempt == 2:
                raise


def _run_once(fn, world_size, args, kwargs, timeout):
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, queue, env, cwd), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = [None] * world_size, []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors.append((rank, payload))
                break  # one failure is enough; the others may hang in collectives
    finally:
        killed = set()
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
                p.join()
                killed.add(p)
    if errors:
        rank, tb = errors[0]
        # A rank that died of a signal never reported; its peers then see only "Connection reset by peer".
        died = [f"rank {r} exited with code {p.exitcode} ({_signal_name(p.exitcode)})"
                for r, p in enumerate(procs) if p not in killed and p.exitcode is not None and p.exitcode < 0
                and r != rank]
        raise RuntimeError(f"rank {rank} failed:\n{tb}" + ("\n" + "; ".join(died) if died else ""))
    return results


def _signal_name(exitcode):
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return "signal"
