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
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

logger = logging.getLogger(__name__)


@dataclass
class AsyncRequest:
    async_fn: Optional[Callable]
    async_fn_args: tuple = ()
    finalize_fns: List[Callable] = field(default_factory=list)
    description: str = ""

    def add_finalize_fn(self, fn: Callable) -> None:
        self.finalize_fns.append(fn)


class _Call:
    def __init__(self, idx: int, request: AsyncRequest, group, previous: Optional[threading.Thread] = None):
        self.idx, self.request, self.error = idx, request, None
        self.thread = threading.Thread(target=self._run, args=(group, previous), daemon=True,
                                       name=f"async-ckpt-{idx}")
        self.thread.start()

    def _run(self, group, previous: Optional[threading.Thread]) -> None:
        if previous is not None:
            # Same order of collectives on the shared group on every rank: strictly one write at a time.
            previous.join()
        try:
            if self.request.async_fn is not None:
                self.request.async_fn(*self.request.async_fn_args, group=group)
        except BaseException as e:  # reported by the finalize step on every rank
            self.error = e


def _all_reduce_flag(value: bool, op) -> bool:
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([int(value)], dtype=torch.int64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=op)
    return bool(t.item())


class AsyncCallsQueue:
    """Pending background saves, finalized in the order they were scheduled."""

    def __init__(self, persistent: bool = False):
        if persistent:
            raise NotImplementedError("AsyncCallsQueue(persistent=True) (a persistent checkpoint worker "
                                      "process) is not supported; each save runs in its own thread")
        self._calls: List[_Call] = []
        self._next_idx = 0
        self._group = None
        self._last_thread: Optional[threading.Thread] = None  # writer of the latest call, finalized or not
        self.failed: List[str] = []

    def _async_group(self):
        if self._group is None and torch.distributed.is_initialized():
            self._group = torch.distributed.new_group(backend="gloo")
        return self._group

    def schedule_async_request(self, request: AsyncRequest) -> int:
        group = self._async_group()
        call = _Call(self._next_idx, request, group, previous=self._last_thread)
        self._last_thread = call.thread
        self._calls.append(call)
        self._next_idx += 1
        return call.idx

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize every leading call that all ranks finished; ``blocking`` waits for all of them.
        Must be called collectively (same calls, same order on every rank)."""
        done_idx = []
        while self._calls:
            call = self._calls[0]
            if blocking:
                call.thread.join()
            local_done = not call.thread.is_alive()
            all_done = local_done if no_dist else _all_reduce_flag(local_done, torch.distributed.ReduceOp.MIN)
            if not all_done:
                break
            self._calls.pop(0)
            local_failed = call.error is not None
            any_failed = local_failed if no_dist else _all_reduce_flag(local_failed, torch.distributed.ReduceOp.MAX)
            if any_failed:
                msg = f"async checkpoint save {call.request.description} failed"
                if local_failed:
                    msg += f" on this rank: {type(call.error).__name__}: {call.error}"
                logger.error(msg)
                print(f"WARNING: {msg}; it was not recorded as a checkpoint", flush=True)
                self.failed.append(call.request.description)
                continue
            for fn in call.request.finalize_fns:
                fn()
            done_idx.append(call.idx)
        return done_idx

    def close(self) -> None:
        """Wait for and finalize every pending save (call at exit)."""
        self.maybe_finalize_async_calls(blocking=True)
