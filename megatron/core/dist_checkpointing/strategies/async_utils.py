"""Background checkpoint writes whose completion is agreed on by all ranks before it is recorded.

`AsyncCallsQueue.schedule_async_request` runs a request's write function in a thread (on a dedicated
gloo group, so its collectives never interleave with training's). Writes run one after another in the
order they were scheduled: two writes in flight at once would issue collectives on that one group from
two threads, in an order that differs between ranks (a deadlock or mixed-up data), so each write thread
first waits for the previous one. `maybe_finalize_async_calls` is called
at the same points on every rank; it all-reduces "done" and "failed" flags and runs the finalize
functions (metadata, rename, tracker) only when every rank finished writing without error.
"""
import logging
import queue
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional

import torch

logger = logging.getLogger(__name__)


@dataclass
class AsyncRequest:
    """A background write: `async_fn(*async_fn_args, **async_fn_kwargs)` runs in the background, then
    `finalize_fns` run on every rank once all ranks finished. With `preload_fn`, its result replaces
    `async_fn_args[1]` when the write starts (Megatron stages the tensors to write that way)."""
    async_fn: Optional[Callable]
    async_fn_args: tuple = ()
    finalize_fns: List[Callable] = field(default_factory=list)
    async_fn_kwargs: Dict = field(default_factory=dict)
    preload_fn: Optional[Callable] = None
    is_frozen: bool = False
    call_idx: int = 0
    description: str = ""

    def add_finalize_fn(self, fn: Callable) -> None:
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def freeze(self) -> "AsyncRequest":
        """A copy to which no finalize function can be added."""
        return replace(self, is_frozen=True)

    def call_args(self) -> list:
        args = list(self.async_fn_args)
        if self.preload_fn is not None:
            args[1] = self.preload_fn()
        return args

    def execute_sync(self) -> None:
        """Run the request in the foreground: the write, a barrier, the finalize functions."""
        if self.async_fn is not None:
            self.async_fn(*self.call_args(), **self.async_fn_kwargs)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        for fn in self.finalize_fns:
            fn()


class _Job:
    """One scheduled request: set `done` when its write returned, `error` if it raised."""

    def __init__(self, request: AsyncRequest):
        self.request, self.error, self.done = request, None, threading.Event()

    def run(self, group, after: Optional[threading.Event] = None) -> None:
        if after is not None:
            # Same order of collectives on the shared group on every rank: strictly one write at a time.
            after.wait()
        try:
            if self.request.async_fn is not None:
                kwargs = dict(self.request.async_fn_kwargs, **({"group": group} if group is not None else {}))
                self.request.async_fn(*self.request.call_args(), **kwargs)
        except BaseException as e:  # reported by the finalize step on every rank
            self.error = e
        finally:
            self.done.set()


class AsyncCaller(ABC):
    """Runs scheduled AsyncRequests in the background and says, agreed over all ranks, whether the
    current one is done. Here the work runs in threads, not processes: our writes issue collectives on
    a dedicated gloo group, which a forked process could not use. When a process group is given, the
    request's function is called with `group=` it."""

    job: Optional[_Job] = None

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start `async_req` (called on every rank)."""

    @abstractmethod
    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """True when the current request finished on every rank (this rank only with `no_dist`);
        `blocking` waits for it. Collective unless `no_dist`."""

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """True when no rank reports its request still running (an all-reduce of `is_alive`)."""
        return not _all_reduce_flag(bool(is_alive), torch.distributed.ReduceOp.MAX)

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Stop the caller: wait for its work, or with `abort` stop waiting for it."""

    def _current_done(self, blocking: bool, no_dist: bool) -> bool:
        if blocking and self.job is not None:
            self.job.done.wait()
        alive = int(self.job is not None and not self.job.done.is_set())
        return not alive if no_dist else self.sync_all_async_calls(alive)


class TemporalAsyncCaller(AsyncCaller):
    """A fresh worker thread for each request (Megatron forks a process per save)."""

    def __init__(self):
        self.thread: Optional[threading.Thread] = None

    def schedule_async_call(self, async_req: AsyncRequest, group=None, after: Optional[threading.Event] = None):
        self.job = _Job(async_req)
        self.thread = threading.Thread(target=self.job.run, args=(group, after), daemon=True, name="async-ckpt")
        self.thread.start()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        done = self._current_done(blocking, no_dist)
        if done:
            self.close()
        return done

    def close(self, abort: bool = False) -> None:
        """Join the worker; with `abort` leave it running unwatched (a thread cannot be killed)."""
        if self.thread is not None and not abort:
            self.thread.join()
        self.thread = None


class PersistentAsyncCaller(AsyncCaller):
    """One long-lived worker thread that runs requests in the order they were scheduled."""

    def __init__(self):
        self.queue: "queue.Queue" = queue.Queue()
        self.thread: Optional[threading.Thread] = None

    def _serve(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            job, group = item
            job.run(group)

    def schedule_async_call(self, async_req: AsyncRequest, group=None) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, daemon=True, name="async-ckpt-worker")
            self.thread.start()
        self.job = _Job(async_req)
        self.queue.put((self.job, group))

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """About the latest scheduled request (the worker keeps running)."""
        return self._current_done(blocking, no_dist)

    def close(self, abort: bool = False) -> None:
        """Let the worker finish the queued requests and stop (`abort`: drop the ones not started)."""
        if self.thread is None:
            return
        if abort:
            while not self.queue.empty():
                self.queue.get_nowait()
        self.queue.put(None)
        if not abort:
            self.thread.join()
        self.thread = None


def _all_reduce_flag(value: bool, op) -> bool:
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([int(value)], dtype=torch.int64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=op)
    return bool(t.item())


class AsyncCallsQueue:
    """Pending background saves, finalized in the order they were scheduled. Each save gets its own
    TemporalAsyncCaller (waiting for the previous save first), or with `persistent` they all go to one
    PersistentAsyncCaller."""

    def __init__(self, persistent: bool = False):
        self.persistent_caller = PersistentAsyncCaller() if persistent else None
        self._calls: List[tuple] = []  # (idx, job, temporal caller or None)
        self._next_idx = 0
        self._group = None
        self._last_job: Optional[_Job] = None  # the latest scheduled save, finalized or not
        self.failed: List[str] = []

    def _async_group(self):
        if self._group is None and torch.distributed.is_initialized():
            self._group = torch.distributed.new_group(backend="gloo")
        return self._group

    def schedule_async_request(self, request: AsyncRequest) -> int:
        group = self._async_group()
        if self.persistent_caller is not None:
            caller = None
            self.persistent_caller.schedule_async_call(request, group)
            job = self.persistent_caller.job
        else:
            caller = TemporalAsyncCaller()
            caller.schedule_async_call(request, group, after=self._last_job.done if self._last_job else None)
            job = caller.job
        self._last_job = job
        self._calls.append((self._next_idx, job, caller))
        self._next_idx += 1
        return self._next_idx - 1

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize every leading call that all ranks finished; ``blocking`` waits for all of them.
        Must be called collectively (same calls, same order on every rank)."""
        done_idx = []
        while self._calls:
            idx, job, caller = self._calls[0]
            if blocking:
                job.done.wait()
            local_done = job.done.is_set()
            all_done = local_done if no_dist else _all_reduce_flag(local_done, torch.distributed.ReduceOp.MIN)
            if not all_done:
                break
            self._calls.pop(0)
            if caller is not None:
                caller.close()
            local_failed = job.error is not None
            any_failed = local_failed if no_dist else _all_reduce_flag(local_failed, torch.distributed.ReduceOp.MAX)
            if any_failed:
                msg = f"async checkpoint save {job.request.description} failed"
                if local_failed:
                    msg += f" on this rank: {type(job.error).__name__}: {job.error}"
                logger.error(msg)
                print(f"WARNING: {msg}; it was not recorded as a checkpoint", flush=True)
                self.failed.append(job.request.description)
                continue
            for fn in job.request.finalize_fns:
                fn()
            done_idx.append(idx)
        return done_idx

    def close(self) -> None:
        """Wait for and finalize every pending save (call at exit)."""
        self.maybe_finalize_async_calls(blocking=True)
        if self.persistent_caller is not None:
            self.persistent_caller.close()
