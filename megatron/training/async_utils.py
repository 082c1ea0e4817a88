"""The application's queue of background checkpoint saves (`--async-save`).

`maybe_finalize_async_save` is called by the training loop every iteration (and with ``blocking=True`` at
exit); it is collective, so every rank must call it at the same points.
"""
import shutil

import torch

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

_async_calls_queue = None


def _queue() -> AsyncCallsQueue:
    global _async_calls_queue
    if _async_calls_queue is None:
        _async_calls_queue = AsyncCallsQueue()
    return _async_calls_queue


def schedule_async_save(async_request: AsyncRequest) -> None:
    _queue().schedule_async_request(async_request)


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
    """Record every background save that all ranks finished; ``blocking`` waits for all pending ones."""
    global _async_calls_queue
    if _async_calls_queue is None:
        return
    failed_before = len(_async_calls_queue.failed)
    _async_calls_queue.maybe_finalize_async_calls(blocking=blocking or terminate)
    _remove_staging(_async_calls_queue.failed[failed_before:])
    if terminate:
        _async_calls_queue = None


def _remove_staging(failed_dirs) -> None:
    """A failed background save (a full disk...) was never published: rank 0 deletes its staging directory
    (``iter_N.tmp``), whose partial files would only take space; the latest checkpoint stays as it was."""
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    for path in failed_dirs:
        if rank0 and path.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)


def is_empty_async_queue() -> bool:
    return _async_calls_queue is None or _async_calls_queue.get_num_unfinalized_calls() == 0


def failed_async_saves():
    return [] if _async_calls_queue is None else list(_async_calls_queue.failed)
